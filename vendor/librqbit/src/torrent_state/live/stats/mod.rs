pub mod atomic;
pub mod snapshot;

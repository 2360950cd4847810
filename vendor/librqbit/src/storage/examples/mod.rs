pub mod inmemory;
pub mod mmap;

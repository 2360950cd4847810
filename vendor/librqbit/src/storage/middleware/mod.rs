pub mod slow;
pub mod timing;
pub mod write_through_cache;

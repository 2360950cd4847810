//! Partition content format: capture used blocks, publish as pieces, restore at disk offsets.

//! Extent lists: sorted, non-overlapping byte ranges of a partition.

/// A used byte range of a partition (offset relative to the partition start).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Extent {
    /// Start offset in bytes.
    pub offset: u64,
    /// Length in bytes (> 0).
    pub len: u64,
}

impl Extent {
    /// End offset (exclusive).
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// Errors of extent-list validation.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ExtentError {
    /// Zero-length extent.
    #[error("extent {index} is empty")]
    Empty {
        /// position in the list
        index: usize,
    },
    /// Not sorted or overlapping the previous one.
    #[error("extent {index} at {offset} overlaps or precedes the previous one")]
    Overlap {
        /// position in the list
        index: usize,
        /// its offset
        offset: u64,
    },
    /// Beyond the partition end.
    #[error("extent {index} ends at {end}, past the partition size {size}")]
    OutOfRange {
        /// position in the list
        index: usize,
        /// its end
        end: u64,
        /// the partition size
        size: u64,
    },
    /// Not aligned to the block size.
    #[error("extent {index} at {offset}+{len} is not aligned to the block size {block}")]
    Unaligned {
        /// position in the list
        index: usize,
        /// its offset
        offset: u64,
        /// its length
        len: u64,
        /// the block size
        block: u64,
    },
}

/// Checks that `extents` are non-empty, sorted, non-overlapping, aligned to
/// `block` (an extent may end unaligned only at `size`) and within `size`.
pub fn validate_extents(extents: &[Extent], block: u64, size: u64) -> Result<(), ExtentError> {
    let mut prev_end = 0u64;
    for (index, e) in extents.iter().enumerate() {
        if e.len == 0 {
            return Err(ExtentError::Empty { index });
        }
        let end = e.offset.checked_add(e.len).ok_or(ExtentError::OutOfRange {
            index,
            end: u64::MAX,
            size,
        })?;
        if index > 0 && e.offset < prev_end {
            return Err(ExtentError::Overlap {
                index,
                offset: e.offset,
            });
        }
        if end > size {
            return Err(ExtentError::OutOfRange { index, end, size });
        }
        if block == 0 || e.offset % block != 0 || (end % block != 0 && end != size) {
            return Err(ExtentError::Unaligned {
                index,
                offset: e.offset,
                len: e.len,
                block,
            });
        }
        prev_end = end;
    }
    Ok(())
}

/// Accumulates used blocks in ascending order into coalesced extents.
#[derive(Debug, Default)]
pub struct ExtentBuilder {
    out: Vec<Extent>,
}

impl ExtentBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `[offset, offset+len)`; merges with the previous extent when
    /// adjacent. Ranges must come in ascending, non-overlapping order; a range
    /// overlapping the previous one is merged into it.
    pub fn push(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        if let Some(last) = self.out.last_mut()
            && offset <= last.end()
        {
            let end = last.end().max(offset.saturating_add(len));
            last.len = end - last.offset;
            return;
        }
        self.out.push(Extent { offset, len });
    }

    /// Number of extents so far.
    pub fn len(&self) -> usize {
        self.out.len()
    }

    /// No extent yet.
    pub fn is_empty(&self) -> bool {
        self.out.is_empty()
    }

    /// The extents.
    pub fn finish(self) -> Vec<Extent> {
        self.out
    }
}

/// Extents of the set bits of a bitmap (bit `i` of byte `i / 8`, least
/// significant bit first, means block `i`), clipped to `size` bytes.
pub fn from_bitmap(bitmap: &[u8], blocks: u64, block: u64, size: u64) -> Vec<Extent> {
    let mut b = ExtentBuilder::new();
    let mut i = 0u64;
    while i < blocks {
        let byte = bitmap.get((i / 8) as usize).copied().unwrap_or(0);
        if byte == 0 && i.is_multiple_of(8) {
            i += 8;
            continue;
        }
        if byte == 0xff && i.is_multiple_of(8) && i + 8 <= blocks {
            push_clipped(&mut b, i * block, 8 * block, size);
            i += 8;
            continue;
        }
        if byte & (1 << (i % 8)) != 0 {
            push_clipped(&mut b, i * block, block, size);
        }
        i += 1;
    }
    b.finish()
}

fn push_clipped(b: &mut ExtentBuilder, off: u64, len: u64, size: u64) {
    if off >= size {
        return;
    }
    b.push(off, len.min(size - off));
}

/// Sum of the extent lengths.
pub fn total_len(extents: &[Extent]) -> u64 {
    extents.iter().map(|e| e.len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_to_extents_coalesces() {
        let bm = [0b0000_0111u8, 0xff, 0x01, 0x80];
        let e = from_bitmap(&bm, 32, 512, 1 << 20);
        assert_eq!(
            e,
            vec![
                Extent {
                    offset: 0,
                    len: 3 * 512
                },
                Extent {
                    offset: 8 * 512,
                    len: 9 * 512
                },
                Extent {
                    offset: 31 * 512,
                    len: 512
                },
            ]
        );
        assert!(validate_extents(&e, 512, 1 << 20).is_ok());
        // clipped at the partition end
        let e = from_bitmap(&[0xff], 8, 512, 1000);
        assert_eq!(
            e,
            vec![Extent {
                offset: 0,
                len: 1000
            }]
        );
        assert!(validate_extents(&e, 512, 1000).is_ok());
    }

    #[test]
    fn validation_rejects_hostile_lists() {
        let ok = Extent {
            offset: 0,
            len: 4096,
        };
        let over = Extent {
            offset: 2048,
            len: 4096,
        };
        assert!(matches!(
            validate_extents(&[ok, over], 512, 1 << 20),
            Err(ExtentError::Overlap { .. })
        ));
        assert!(matches!(
            validate_extents(
                &[Extent {
                    offset: 0,
                    len: 8192
                }],
                512,
                4096
            ),
            Err(ExtentError::OutOfRange { .. })
        ));
        assert!(matches!(
            validate_extents(
                &[Extent {
                    offset: 100,
                    len: 512
                }],
                512,
                4096
            ),
            Err(ExtentError::Unaligned { .. })
        ));
        assert!(matches!(
            validate_extents(
                &[Extent {
                    offset: u64::MAX - 10,
                    len: 512
                }],
                512,
                u64::MAX
            ),
            Err(ExtentError::OutOfRange { .. })
        ));
        assert!(matches!(
            validate_extents(&[Extent { offset: 0, len: 0 }], 512, 4096),
            Err(ExtentError::Empty { .. })
        ));
    }
}

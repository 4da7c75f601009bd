//! Staging buffers: where the pin stage puts a micro-batch (x then y, u32) for the upload to
//! read. Plain host memory everywhere; in a `cuda` build also page-locked memory from the CUDA
//! driver, which lets a copy to the GPU run asynchronously on its own stream.
//!
//! A page-locked buffer remembers its last copy (a CUDA event): writing into it again first
//! waits for that copy to complete, so a buffer that went back to the pool while its copy was
//! still in flight is never overwritten under it.

/// One staging buffer.
pub enum Staging {
    /// Pageable host memory.
    Host(Vec<u32>),
    /// Page-locked host memory (write-combined: fast to write, slow to read on the host).
    Pinned(crate::device::cuda_copy::PinnedBuffer),
}

impl Staging {
    /// Capacity in tokens.
    #[cfg(feature = "tools")]
    pub fn len(&self) -> usize {
        match self {
            Staging::Host(v) => v.len(),
            Staging::Pinned(p) => p.len(),
        }
    }

    /// True for a zero-length buffer.
    #[cfg(feature = "tools")]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tokens (for a page-locked buffer, after its last copy completed).
    pub fn as_slice(&self) -> anyhow::Result<&[u32]> {
        match self {
            Staging::Host(v) => Ok(v),
            Staging::Pinned(p) => Ok(p.as_slice()?),
        }
    }

    /// The tokens, to write (for a page-locked buffer, after its last copy completed).
    pub fn as_mut_slice(&mut self) -> anyhow::Result<&mut [u32]> {
        match self {
            Staging::Host(v) => Ok(v),
            Staging::Pinned(p) => Ok(p.as_mut_slice()?),
        }
    }

    /// True for page-locked memory.
    pub fn is_pinned(&self) -> bool {
        !matches!(self, Staging::Host(_))
    }
}

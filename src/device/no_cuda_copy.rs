//! The stand-in for [`cuda_copy`](self) in a build without the `cuda` feature: the same API, so
//! that the staging buffers, the pin and upload stages and the parity check carry no `cfg`.
//! Nothing here can be made: page-locked buffers and copiers are uninhabited types, and the
//! functions that would make one say which build is needed.

use candle_core::{Device, Tensor};

/// How many copies the copy stream keeps in flight (as in the `cuda` build).
pub const RING: usize = 4;

/// No value: what a stand-in type holds, so that it cannot exist.
#[derive(Debug)]
enum Never {}

fn needs_cuda(what: &str) -> anyhow::Error {
    anyhow::anyhow!("{what} needs the `cuda` build (scripts/build-cuda.sh)")
}

/// A page-locked host buffer; none exists in this build.
#[derive(Debug)]
pub struct PinnedBuffer(Never);

impl PinnedBuffer {
    /// Capacity in u32 elements.
    pub fn len(&self) -> usize {
        match self.0 {}
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }

    /// The elements.
    pub fn as_slice(&self) -> anyhow::Result<&[u32]> {
        match self.0 {}
    }

    /// The elements, to write.
    pub fn as_mut_slice(&mut self) -> anyhow::Result<&mut [u32]> {
        match self.0 {}
    }
}

/// Page-locked buffers: an error in this build.
pub fn pinned_buffers(_device: &Device, _n: usize, _len: usize) -> anyhow::Result<Vec<PinnedBuffer>> {
    Err(needs_cuda("page-locked memory"))
}

/// Copies micro-batches to a GPU; none exists in this build.
pub struct Copier(Never);

impl Copier {
    /// A copier: an error in this build.
    pub fn new(_device: &Device, _dedicated: bool) -> anyhow::Result<Self> {
        Err(needs_cuda("a CUDA copy"))
    }

    /// See the `cuda` build.
    pub fn copy(&mut self, _src: &PinnedBuffer, _rows: usize, _seq_len: usize) -> anyhow::Result<(Tensor, Tensor)> {
        match self.0 {}
    }

    /// See the `cuda` build.
    pub fn finished(&mut self) -> anyhow::Result<Vec<u64>> {
        match self.0 {}
    }

    /// See the `cuda` build.
    pub fn drain(&mut self) -> anyhow::Result<Vec<u64>> {
        match self.0 {}
    }
}

/// The copy check of `pipeline parity`: an error in this build.
pub fn check_copies(_device: &Device, _dedicated: bool, _batches: usize) -> anyhow::Result<(usize, usize)> {
    Err(needs_cuda("the copy check"))
}

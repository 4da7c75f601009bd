//! Kind `shard_reader`: opens and checks the shards of `[data] train` (or `val`) and hands them
//! to the sampler, one message per shard, in sorted order.
//!
//! - `mmap`: tokens are read through a memory map (memmap2); pages read are released from the
//!   process every 64 MiB, so resident memory stays small whatever the glob's size;
//! - `pread`: tokens are read with positioned reads into the sampler's buffers; nothing is
//!   mapped.
//!
//! Each file's header is checked against its size (magic, version, token count); a damaged
//! file stops the run with its name and the problem. With `rank_shards`, only the shards this
//! rank samples from (`index % world_size == rank`, as the shuffled loader deals them) are
//! opened.

use std::path::PathBuf;
use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::config;
use crate::data::batch::Shard;
use crate::data::shard::{AccessMode, ShardFile, glob_sorted, read_header};
use crate::runtime::stage::{BuildCtx, Ctx, Source};

/// Which split a reader reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// `[data] train`.
    #[default]
    Train,
    /// `[data] val`.
    Val,
}

/// Parameters of `shard_reader/mmap` and `shard_reader/pread`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ReaderParams {
    /// Which glob of `[data]` to read: "train" or "val".
    pub split: Split,
    /// Open only the shards this rank samples from (index % world_size == rank).
    pub rank_shards: bool,
}

fn files_of(p: &ReaderParams, ctx: &BuildCtx) -> anyhow::Result<Vec<PathBuf>> {
    let (key, glob) = match p.split {
        Split::Train => ("data.train", &config(ctx)?.data.train),
        Split::Val => ("data.val", &config(ctx)?.data.val),
    };
    let glob = glob.as_deref().ok_or_else(|| anyhow::anyhow!("`{key}` is not set: give the glob of the shards to read"))?;
    glob_sorted(glob)
}

/// The stage body shared by both implementations.
pub struct Reader {
    mode: AccessMode,
    files: Vec<(usize, PathBuf)>,
    next: usize,
}

impl Reader {
    fn build(mode: AccessMode, p: ReaderParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        let (world, rank) = (ctx.run.world_size.max(1), ctx.run.rank);
        let files: Vec<(usize, PathBuf)> =
            files_of(&p, ctx)?.into_iter().enumerate().filter(|(i, _)| !p.rank_shards || i % world == rank).collect();
        Ok(Self { mode, files, next: 0 })
    }

    fn check(p: &ReaderParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        for f in files_of(p, ctx)? {
            read_header(&f)?;
        }
        Ok(())
    }

    fn next(&mut self) -> anyhow::Result<Option<Shard>> {
        let Some((index, path)) = self.files.get(self.next) else { return Ok(None) };
        self.next += 1;
        let mut file = ShardFile::open(path, *index, self.mode)?;
        file.share_budget_with(self.files.len());
        Ok(Some(Shard(Arc::new(file))))
    }
}

macro_rules! reader_impl {
    ($ty:ident, $name:literal, $mode:expr, $doc:literal) => {
        #[doc = $doc]
        pub struct $ty(Reader);

        impl Source for $ty {
            const KIND: &'static str = "shard_reader";
            const IMPL: &'static str = $name;
            const DOC: &'static str = $doc;
            type Params = ReaderParams;
            type Out = Shard;

            fn check(p: &ReaderParams, ctx: &BuildCtx) -> anyhow::Result<()> {
                Reader::check(p, ctx)
            }
            fn build(p: ReaderParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
                Ok(Self(Reader::build($mode, p, ctx)?))
            }
            fn next(&mut self, _ctx: &mut Ctx) -> anyhow::Result<Option<Shard>> {
                self.0.next()
            }
        }
    };
}

reader_impl!(
    Mmap,
    "mmap",
    AccessMode::Mmap,
    "Checks and memory-maps each shard of [data] train/val (memmap2); pages are released as they are read."
);
reader_impl!(
    Pread,
    "pread",
    AccessMode::Pread,
    "Checks each shard of [data] train/val and reads windows with positioned reads; nothing is mapped."
);

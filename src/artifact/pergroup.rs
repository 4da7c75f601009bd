//! The `pergroup` codec: the 04-27 record's per-group compression of the artifact's container
//! (`codec = "pergroup"`). The record measured about 280 kB less than Brotli alone on its model,
//! for about 75 s more compression; ZPAQ being symmetric, reading it back takes about as long
//! again (the groups in parallel), and that counts against evaluation.
//!
//! [`pack`] takes the serialized safetensors container ([`super::format`]) and routes the int8
//! values (`NAME.q`, `I8`, 2-D) of the matrices of one role into one group each, in the
//! record's order: `tok_emb.weight`, then across the layers `blocks.N.attn.c_k.weight`,
//! `attn.c_q.weight`, `attn.c_v.weight`, `attn.proj.weight`, `mlp.fc.weight`,
//! `mlp.proj.weight`. A group is its matrices in layer order, each written column-major
//! (transposed); in the hot groups (`tok_emb`, `attn.c_q`, `mlp.fc`) each matrix's rows are
//! first reordered by a greedy L1 nearest-neighbour walk ([`similarity_order`]: from row 0, the
//! unused row closest to the current one), so that similar rows sit side by side, and the
//! permutation is stored (u16; matrices of more than 65,536 rows are not sorted). Each group is
//! compressed with `lrzip`'s ZPAQ back end ([`super::lrzip`]; `level` is lrzip's `-L`, 1..=9).
//! Every other tensor, and the container's metadata with the groups' layout, go into a
//! remainder safetensors container, byte-shuffled with the artifact's `byte_shuffle` stride
//! when it is not 0 ([`super::shuffle`]); the remainder and the permutations are Brotli,
//! quality 11, window 2^24. [`unpack`] gives the container back byte for byte (checked by
//! [`pack`] before it compresses anything), so the artifact header's length and checksum are
//! the container's, as with the other codecs.
//!
//! # Format (version [`VERSION`])
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic [`MAGIC`] (`PGRP`) |
//! | 4 | 1 | version ([`VERSION`]) |
//! | 5 | 1 | stream count `n` (1 to 9) |
//! | 6 | 25 `n` | the table, one entry per stream in increasing id: id (1 byte), raw length (u64 LE), packed length (u64 LE), first 8 bytes of the SHA-256 of the raw stream |
//! | 6 + 25 `n` | the rest | the packed streams, in table order, back to back |
//!
//! Stream ids: 0 the remainder (always there; Brotli), 1 the permutations (when a matrix was
//! sorted; Brotli), 2 + `g` group `g` of [`GROUPS`] (when it has a matrix; lrzip). The
//! remainder's metadata has one key, `pipeline.pergroup`, a JSON layout: `{"metadata": {...}
//! (the container's own, or null), "groups": [{"group": "mlp.fc", "tensors": [{"name":
//! "blocks.0.mlp.fc.weight.q", "rows", "cols", "sorted"}, ...]}, ...]}`, groups in stream order.
//!
//! [`unpack`] checks the head, the table, every stream's length and checksum, and the layout
//! against the streams; a truncated, corrupted or foreign body is an error naming the stream
//! (the group), never a panic.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;

use anyhow::{Context, Result, ensure};
use rayon::prelude::*;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::lrzip::Lrzip;
use super::shuffle::{shuffle, unshuffle};

/// First four bytes of a pergroup body.
pub const MAGIC: [u8; 4] = *b"PGRP";

/// Version of the pergroup body.
pub const VERSION: u8 = 1;

/// The lrzip levels (`-L`); the default is the strongest, as in the record.
pub const LEVELS: std::ops::RangeInclusive<i32> = 1..=9;

const HEAD_LEN: usize = 6;
const ENTRY_LEN: usize = 25;
const LAYOUT_KEY: &str = "pipeline.pergroup";
const REMAINDER: u8 = 0;
const PERMUTATIONS: u8 = 1;
const FIRST_GROUP: u8 = 2;
/// Rows a stored (u16) permutation can index.
const MAX_SORTED_ROWS: usize = 1 << 16;
/// Brotli's window for the remainder and the permutations (2^24, as the record).
const BROTLI_WINDOW: i32 = 24;

/// A group of matrices of one role.
#[derive(Clone, Copy, Debug)]
pub struct Group {
    /// Its name: the weight's name after `blocks.N.` without `.weight` (`tok_emb` for the
    /// embedding).
    pub name: &'static str,
    /// Whether its matrices' rows are similarity-sorted.
    pub sorted: bool,
}

/// The groups, in stream order (the record's).
pub const GROUPS: [Group; 7] = [
    Group { name: "tok_emb", sorted: true },
    Group { name: "attn.c_k", sorted: false },
    Group { name: "attn.c_q", sorted: true },
    Group { name: "attn.c_v", sorted: false },
    Group { name: "attn.proj", sorted: false },
    Group { name: "mlp.fc", sorted: true },
    Group { name: "mlp.proj", sorted: false },
];

/// The group and layer of a stored tensor name (`tok_emb.weight.q`: group 0, layer 0;
/// `blocks.3.mlp.fc.weight.q`: `mlp.fc`, layer 3), or `None`.
pub fn route(name: &str) -> Option<(usize, usize)> {
    let base = name.strip_suffix(".weight.q")?;
    if base == "tok_emb" {
        return Some((0, 0));
    }
    let (layer, role) = base.strip_prefix("blocks.")?.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let g = GROUPS.iter().skip(1).position(|g| g.name == role)? + 1;
    Some((g, layer.parse().ok()?))
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Layout {
    metadata: Option<BTreeMap<String, String>>,
    groups: Vec<GroupLayout>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupLayout {
    group: String,
    tensors: Vec<Matrix>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Matrix {
    name: String,
    rows: usize,
    cols: usize,
    sorted: bool,
}

/// One entry of the stream table.
struct Entry {
    id: u8,
    raw_len: u64,
    packed_len: u64,
    checksum: [u8; 8],
}

fn checksum(data: &[u8]) -> [u8; 8] {
    let digest = Sha256::digest(data);
    let mut out = [0u8; 8];
    out.copy_from_slice(&digest[..8]);
    out
}

/// How errors name stream `id`.
fn label(id: u8) -> String {
    match id {
        REMAINDER => "the remainder".into(),
        PERMUTATIONS => "the permutations".into(),
        g => match GROUPS.get(usize::from(g - FIRST_GROUP)) {
            Some(g) => format!("group `{}`", g.name),
            None => format!("unknown stream {g}"),
        },
    }
}

/// The greedy L1 nearest-neighbour order of the `rows x cols` int8 matrix `m` (row-major):
/// row 0 first, then again and again the unused row closest in L1 distance to the last one
/// taken (ties: the lowest index). `order[i]` is the original index of the `i`-th row.
pub fn similarity_order(m: &[i8], rows: usize, cols: usize) -> Vec<u32> {
    assert_eq!(m.len(), rows * cols, "a {rows} x {cols} matrix");
    if rows == 0 {
        return Vec::new();
    }
    // Offset binary: the same differences, and a sum of absolute differences of bytes, which
    // compilers vectorize.
    let biased: Vec<u8> = m.iter().map(|&v| (v as u8) ^ 0x80).collect();
    let row = |i: u32| &biased[i as usize * cols..(i as usize + 1) * cols];
    let dist = |a: &[u8], b: &[u8]| -> u32 { a.iter().zip(b).map(|(&x, &y)| (i32::from(x) - i32::from(y)).unsigned_abs()).sum() };
    let mut order = Vec::with_capacity(rows);
    order.push(0u32);
    let mut left: Vec<u32> = (1..rows as u32).collect();
    let mut cur = 0u32;
    while !left.is_empty() {
        let here = row(cur);
        let key = |(k, &i): (usize, &u32)| (dist(here, row(i)), i, k);
        let best =
            if left.len() * cols >= 1 << 16 { left.par_iter().enumerate().map(key).min() } else { left.iter().enumerate().map(key).min() };
        let (_, i, k) = best.expect("rows are left");
        left.swap_remove(k);
        order.push(i);
        cur = i;
    }
    order
}

/// Appends the `rows x cols` matrix `m` (row-major), its rows taken in `order` when given,
/// column-major to `out`.
fn write_columns(m: &[u8], rows: usize, cols: usize, order: Option<&[u32]>, out: &mut Vec<u8>) {
    let at = out.len();
    out.resize(at + rows * cols, 0);
    let dst = &mut out[at..];
    for i in 0..rows {
        let src = order.map_or(i, |o| o[i] as usize);
        for (c, &v) in m[src * cols..(src + 1) * cols].iter().enumerate() {
            dst[c * rows + i] = v;
        }
    }
}

/// Reverses [`write_columns`]: the row-major matrix of the column-major `cm`.
fn read_columns(cm: &[u8], rows: usize, cols: usize, order: Option<&[u32]>) -> Vec<u8> {
    let mut m = vec![0u8; rows * cols];
    for i in 0..rows {
        let dst = order.map_or(i, |o| o[i] as usize);
        for (c, v) in m[dst * cols..(dst + 1) * cols].iter_mut().enumerate() {
            *v = cm[c * rows + i];
        }
    }
    m
}

fn brotli_compress(data: &[u8]) -> Result<Vec<u8>> {
    let params = brotli::enc::BrotliEncoderParams { quality: 11, lgwin: BROTLI_WINDOW, ..Default::default() };
    let mut out = Vec::new();
    brotli::BrotliCompress(&mut &data[..], &mut out, &params)?;
    Ok(out)
}

fn brotli_decompress(data: &[u8], len: usize) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    brotli::Decompressor::new(data, 4096).take(len as u64 + 1).read_to_end(&mut out).context("Brotli cannot decode it")?;
    ensure!(out.len() == len, "it decompresses to {} bytes, the table says {len}", out.len());
    Ok(out)
}

/// Packs the safetensors `container` (module documentation): groups through lrzip at `level`
/// (1..=9), the rest byte-shuffled with `shuffle_stride` (0: none) and Brotli. Errors when
/// the container does not parse, when lrzip is needed and missing, or when the container is not
/// in the form safetensors writes (then it could not be rebuilt byte for byte).
pub fn pack(container: &[u8], shuffle_stride: u8, level: i32) -> Result<Vec<u8>> {
    ensure!(LEVELS.contains(&level), "pergroup level {level} is outside {}..={} (lrzip's -L)", LEVELS.start(), LEVELS.end());
    let streams = split(container, shuffle_stride)?;
    let lrzip = if streams.iter().any(|s| s.0 >= FIRST_GROUP) { Some(Lrzip::locate()?) } else { None };
    let packed: Vec<Vec<u8>> = streams
        .par_iter()
        .map(|(id, raw)| {
            match *id {
                REMAINDER | PERMUTATIONS => brotli_compress(raw),
                _ => lrzip.as_ref().context("lrzip is not located").and_then(|lz| lz.compress(raw, level, &label(*id))),
            }
            .with_context(|| format!("cannot compress {}", label(*id)))
        })
        .collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(HEAD_LEN + ENTRY_LEN * streams.len() + packed.iter().map(Vec::len).sum::<usize>());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(streams.len() as u8);
    for ((id, raw), p) in streams.iter().zip(&packed) {
        out.push(*id);
        out.extend_from_slice(&(raw.len() as u64).to_le_bytes());
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(&checksum(raw));
    }
    for p in &packed {
        out.extend_from_slice(p);
    }
    Ok(out)
}

/// The raw streams of `container`, (id, bytes) in increasing id: the remainder (shuffled with
/// `shuffle_stride` when not 0), the permutations when a matrix was sorted, then the groups
/// that have a matrix. Checked to [`join`] back into `container` byte for byte.
fn split(container: &[u8], shuffle_stride: u8) -> Result<Vec<(u8, Vec<u8>)>> {
    let (_, meta) = SafeTensors::read_metadata(container).context("pergroup packs a safetensors container; this one does not parse")?;
    let st = SafeTensors::deserialize(container).context("pergroup packs a safetensors container; this one does not parse")?;
    let mut names = st.names();
    names.sort();
    let mut routed: Vec<Vec<(usize, &str, TensorView<'_>)>> = vec![Vec::new(); GROUPS.len()];
    let mut rest = Vec::new();
    for name in names {
        let v = st.tensor(name)?;
        match route(name) {
            Some((g, layer)) if v.dtype() == StDtype::I8 && v.shape().len() == 2 && !v.data().is_empty() => {
                routed[g].push((layer, name, v))
            }
            _ => rest.push((name, v)),
        }
    }
    let mut layout = Layout { metadata: meta.metadata().clone().map(|m| m.into_iter().collect()), groups: Vec::new() };
    let mut perms = Vec::new();
    let mut groups: Vec<(u8, Vec<u8>)> = Vec::new();
    for (g, mut mats) in routed.into_iter().enumerate() {
        if mats.is_empty() {
            continue;
        }
        mats.sort_by_key(|&(layer, ..)| layer);
        let mut raw = Vec::with_capacity(mats.iter().map(|(.., v)| v.data().len()).sum());
        let mut tensors = Vec::with_capacity(mats.len());
        for (_, name, v) in mats {
            let (rows, cols) = (v.shape()[0], v.shape()[1]);
            let sorted = GROUPS[g].sorted && rows > 1 && rows <= MAX_SORTED_ROWS;
            let data = v.data();
            let order = if sorted {
                let q: Vec<i8> = data.iter().map(|&b| b as i8).collect();
                let order = similarity_order(&q, rows, cols);
                perms.extend(order.iter().flat_map(|&i| (i as u16).to_le_bytes()));
                Some(order)
            } else {
                None
            };
            write_columns(data, rows, cols, order.as_deref(), &mut raw);
            tensors.push(Matrix { name: name.to_string(), rows, cols, sorted });
        }
        layout.groups.push(GroupLayout { group: GROUPS[g].name.into(), tensors });
        groups.push((FIRST_GROUP + g as u8, raw));
    }
    let meta = HashMap::from([(LAYOUT_KEY.to_string(), serde_json::to_string(&layout)?)]);
    let remainder = safetensors::serialize(rest, Some(meta)).context("cannot write the remainder container")?;
    let remainder = if shuffle_stride == 0 { remainder } else { shuffle(&remainder, shuffle_stride)? };
    let mut streams = vec![(REMAINDER, remainder)];
    if !perms.is_empty() {
        streams.push((PERMUTATIONS, perms));
    }
    streams.extend(groups);
    // Every step is lossless; this is where byte-exactness rests on the container being in the
    // form the safetensors crate writes (tensors sorted by dtype and name, minimal padding).
    let back = join(&streams).context("pergroup cannot rebuild the container it packs")?;
    ensure!(
        back == container,
        "pergroup cannot give this container back byte for byte (it is not in the form the safetensors crate writes); use brotli"
    );
    Ok(streams)
}

/// The table of a pergroup body, and where its streams start.
fn read_table(body: &[u8]) -> Result<(Vec<Entry>, usize)> {
    ensure!(
        body.len() >= HEAD_LEN,
        "the pergroup body is {} bytes, shorter than its {HEAD_LEN}-byte head (truncated, or not a pergroup body)",
        body.len()
    );
    ensure!(body[..4] == MAGIC, "not a pergroup body (the first bytes are {:?}, expected {:?})", &body[..4], MAGIC);
    ensure!(body[4] == VERSION, "pergroup version {} (byte 4) is not supported (this build reads {VERSION})", body[4]);
    let n = usize::from(body[5]);
    ensure!((1..=GROUPS.len() + 2).contains(&n), "the pergroup body gives {n} streams (byte 5); it has 1 to {}", GROUPS.len() + 2);
    let start = HEAD_LEN + ENTRY_LEN * n;
    ensure!(body.len() >= start, "the pergroup body ends inside its table of {n} streams (truncated)");
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let mut entries: Vec<Entry> = Vec::with_capacity(n);
    for k in 0..n {
        let at = HEAD_LEN + ENTRY_LEN * k;
        let e = Entry { id: body[at], raw_len: u64_at(at + 1), packed_len: u64_at(at + 9), checksum: body[at + 17..at + 25].try_into()? };
        ensure!(
            usize::from(e.id) < GROUPS.len() + 2 && entries.last().is_none_or(|p| p.id < e.id),
            "stream {} of {n} in the pergroup table has id {}: ids are 0 to {} in increasing order",
            k + 1,
            e.id,
            GROUPS.len() + 1
        );
        entries.push(e);
    }
    ensure!(entries[0].id == REMAINDER, "the pergroup body has no remainder stream (its first id is {})", entries[0].id);
    let total = entries.iter().try_fold(0u64, |s, e| s.checked_add(e.packed_len)).context("the pergroup streams' lengths overflow")?;
    ensure!(
        (body.len() - start) as u64 == total,
        "the pergroup streams add up to {total} bytes, the body holds {} after its table (truncated or extended)",
        body.len() - start
    );
    Ok((entries, start))
}

/// Gives back the container [`pack`] packed. Errors say which stream (group) is wrong.
pub fn unpack(body: &[u8]) -> Result<Vec<u8>> {
    let (entries, mut at) = read_table(body)?;
    let n = entries.len();
    let mut slices = Vec::with_capacity(n);
    for e in &entries {
        let len = e.packed_len as usize;
        slices.push(&body[at..at + len]);
        at += len;
    }
    let lrzip = if entries.iter().any(|e| e.id >= FIRST_GROUP) {
        Some(Lrzip::locate().context("the pergroup body's groups are lrzip streams")?)
    } else {
        None
    };
    let raws: Vec<Vec<u8>> = entries
        .par_iter()
        .zip(slices)
        .enumerate()
        .map(|(k, (e, packed))| {
            let what = format!("{} (stream {} of {n} of the pergroup body)", label(e.id), k + 1);
            let len = usize::try_from(e.raw_len).with_context(|| format!("{what}: raw length {} is too large", e.raw_len))?;
            let raw = match e.id {
                REMAINDER | PERMUTATIONS => brotli_decompress(packed, len),
                _ => lrzip.as_ref().context("lrzip is not located").and_then(|lz| lz.decompress(packed, len, &label(e.id))),
            }
            .with_context(|| format!("cannot decompress {what}"))?;
            ensure!(checksum(&raw) == e.checksum, "{what} does not match its checksum (corrupted)");
            Ok(raw)
        })
        .collect::<Result<_>>()?;
    let streams: Vec<(u8, Vec<u8>)> = entries.iter().map(|e| e.id).zip(raws).collect();
    join(&streams).context("the pergroup body does not give back its container")
}

/// The container of the raw `streams` (what [`split`] gives: increasing ids, the remainder
/// first).
fn join(streams: &[(u8, Vec<u8>)]) -> Result<Vec<u8>> {
    let mut remainder = None;
    let mut perms: &[u8] = &[];
    let mut groups = Vec::new();
    for (id, raw) in streams {
        match *id {
            REMAINDER => remainder = Some(unshuffle(raw.clone()).context("the remainder's byte shuffle is malformed")?),
            PERMUTATIONS => perms = raw,
            _ => groups.push((*id, raw.as_slice())),
        }
    }
    let remainder = remainder.context("there is no remainder stream")?;
    rebuild(&remainder, &groups, perms)
}

/// Checks that `order` is a permutation of `0..len`.
fn check_permutation(order: &[u32], len: usize) -> Result<()> {
    let mut seen = vec![false; len];
    for &i in order {
        let s = seen.get_mut(i as usize).with_context(|| format!("it holds row {i} of {len}"))?;
        ensure!(!*s, "it holds row {i} twice");
        *s = true;
    }
    Ok(())
}

/// The container of the `remainder` container, the raw `groups` (stream id, bytes) and the
/// permutations `perms`, as its layout says.
fn rebuild(remainder: &[u8], groups: &[(u8, &[u8])], perms: &[u8]) -> Result<Vec<u8>> {
    let (_, meta) = SafeTensors::read_metadata(remainder).context("the remainder is not a safetensors container")?;
    let layout = meta.metadata().as_ref().and_then(|m| m.get(LAYOUT_KEY)).context("the remainder has no `pipeline.pergroup` layout")?;
    let layout: Layout = serde_json::from_str(layout).context("the remainder's layout is not valid")?;
    let st = SafeTensors::deserialize(remainder).context("the remainder is not a safetensors container")?;
    ensure!(
        layout.groups.len() == groups.len(),
        "the layout lists {} groups, the body holds {} group streams",
        layout.groups.len(),
        groups.len()
    );
    let mut names: HashSet<String> = st.names().into_iter().map(str::to_string).collect();
    let mut perm_at = 0usize;
    let mut matrices: Vec<(String, [usize; 2], Vec<u8>)> = Vec::new();
    for (gl, (id, raw)) in layout.groups.iter().zip(groups) {
        let g = usize::from(id - FIRST_GROUP);
        let what = label(*id);
        ensure!(gl.group == GROUPS[g].name, "the layout's group `{}` stands where the body holds {what}", gl.group);
        let mut at = 0usize;
        for m in &gl.tensors {
            ensure!(route(&m.name).map(|r| r.0) == Some(g), "{what} lists tensor `{}`, which is not one of its", m.name);
            ensure!(names.insert(m.name.clone()), "tensor `{}` is stored twice", m.name);
            let len = m.rows.checked_mul(m.cols).with_context(|| format!("{what}: tensor `{}` is too large", m.name))?;
            let cm = raw
                .get(at..at.saturating_add(len))
                .with_context(|| format!("{what} ends inside tensor `{}` ({} bytes; truncated)", m.name, raw.len()))?;
            at += len;
            let order = if m.sorted {
                ensure!(m.rows <= MAX_SORTED_ROWS, "{what}: tensor `{}` is sorted, but its {} rows exceed u16", m.name, m.rows);
                let bytes = perms
                    .get(perm_at..perm_at + 2 * m.rows)
                    .with_context(|| format!("the permutations end before that of `{}` ({} bytes)", m.name, perms.len()))?;
                perm_at += 2 * m.rows;
                let order: Vec<u32> = bytes.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))).collect();
                check_permutation(&order, m.rows).with_context(|| format!("the permutation of `{}` is not one", m.name))?;
                Some(order)
            } else {
                None
            };
            matrices.push((m.name.clone(), [m.rows, m.cols], read_columns(cm, m.rows, m.cols, order.as_deref())));
        }
        ensure!(at == raw.len(), "{what} holds {} bytes, its layout {at}", raw.len());
    }
    ensure!(perm_at == perms.len(), "the permutations hold {} bytes, the layout uses {perm_at}", perms.len());
    let mut views: Vec<(String, TensorView<'_>)> = Vec::with_capacity(names.len());
    for name in st.names() {
        views.push((name.to_string(), st.tensor(name)?));
    }
    for (name, shape, bytes) in &matrices {
        views.push((name.clone(), TensorView::new(StDtype::I8, shape.to_vec(), bytes)?));
    }
    let metadata = layout.metadata.map(|m| m.into_iter().collect::<HashMap<_, _>>());
    Ok(safetensors::serialize(views, metadata)?)
}

/// Fails, naming what to install, when packing with `pergroup` would (lrzip missing).
pub fn check_available() -> Result<()> {
    Lrzip::locate().map(|_| ()).context("`codec = \"pergroup\"` compresses its weight groups with lrzip")
}

/// The stream sizes of a pergroup body: (label, raw bytes, packed bytes), in table order.
#[cfg(feature = "tools")]
pub fn stream_sizes(body: &[u8]) -> Result<Vec<(String, u64, u64)>> {
    Ok(read_table(body)?.0.iter().map(|e| (label(e.id), e.raw_len, e.packed_len)).collect())
}

#[cfg(test)]
mod tests;

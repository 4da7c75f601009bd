//! Tests of [`super`]. Those that run lrzip say they are skipped where it is not installed (CI
//! installs it: `.ci/run`).

use std::time::Instant;

use candle_core::{Device, Tensor};

use super::*;
use crate::artifact::codec::Codec;
use crate::artifact::format::{HEADER_LEN, from_bytes};
use crate::artifact::lrzip::installed_or_skip;
use crate::artifact::quant::{QuantConfig, Quantized, Rounding, quantize};
use crate::artifact::synthetic::normal;
use crate::model::ModelConfig;

/// A model of realistic names and shapes (several layers, 2x MLP), small enough for tests but
/// with every matrix above the passthrough size, so that every group is there.
fn small_model() -> ModelConfig {
    ModelConfig { vocab_size: 256, num_layers: 2, model_dim: 272, num_heads: 4, num_kv_heads: 4, mlp_mult: 2, ..ModelConfig::default() }
}

/// A hand-made container with every group (tiny matrices, three layers), a few other tensors
/// and some metadata: what the tests of bad bodies run lrzip on, quickly.
fn tiny_container() -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(8);
    let mut tensors: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> =
        vec![("tok_emb.weight.q".into(), StDtype::I8, vec![40, 16], (0..640).map(|_| rng.u8(..) % 9).collect())];
    for layer in 0..3 {
        for g in &GROUPS[1..] {
            let data = (0..24 * 16).map(|_| rng.u8(..) % 7).collect();
            tensors.push((format!("blocks.{layer}.{}.weight.q", g.name), StDtype::I8, vec![24, 16], data));
            tensors.push((format!("blocks.{layer}.{}.weight.scale", g.name), StDtype::F16, vec![24], vec![0x3c; 48]));
        }
    }
    tensors.push(("lm_head.weight.q".into(), StDtype::I8, vec![4, 4], vec![1; 16]));
    let views = tensors.iter().map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()));
    safetensors::serialize(views, Some(HashMap::from([("k".to_string(), "v".to_string())]))).unwrap()
}

/// Weights of `model`'s shapes that look trained: each matrix a rank-8 part plus noise, rows of
/// unequal size, and some embedding rows repeated (rare tokens that barely moved from one
/// another); vectors near one.
fn trained_like(model: &ModelConfig, seed: u64) -> Vec<(String, Tensor)> {
    let mut rng = fastrand::Rng::with_seed(seed);
    model
        .param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if shape.len() == 2 && n > 4096 {
                let (rows, cols) = (shape[0], shape[1]);
                const RANK: usize = 8;
                let u: Vec<f64> = (0..rows * RANK).map(|_| normal(&mut rng)).collect();
                let v: Vec<f64> = (0..RANK * cols).map(|_| normal(&mut rng)).collect();
                let row_scale: Vec<f64> = (0..rows).map(|_| (0.5 * normal(&mut rng)).exp()).collect();
                let mut w: Vec<f32> = (0..rows * cols)
                    .map(|k| {
                        let (r, c) = (k / cols, k % cols);
                        let low: f64 = (0..RANK).map(|j| u[r * RANK + j] * v[j * cols + c]).sum();
                        (0.02 * row_scale[r] * (0.3 * low + normal(&mut rng))) as f32
                    })
                    .collect();
                if name == "tok_emb.weight" {
                    for r in (rows / 2..rows).step_by(3) {
                        let from = rng.usize(..rows / 2);
                        w.copy_within(from * cols..(from + 1) * cols, r * cols);
                    }
                }
                w
            } else {
                (0..n).map(|_| (1.0 + 0.1 * normal(&mut rng)) as f32).collect()
            };
            (name, Tensor::from_vec(values, shape, &Device::Cpu).unwrap())
        })
        .collect()
}

/// The record's int6 quantization (int8 embedding) of [`trained_like`] weights.
fn quantized(model: &ModelConfig, seed: u64) -> Quantized {
    quantize(&trained_like(model, seed), &QuantConfig::record(), Rounding::Nearest).unwrap()
}

#[test]
fn routes_the_record_groups_and_nothing_else() {
    assert_eq!(route("tok_emb.weight.q"), Some((0, 0)));
    assert_eq!(route("blocks.0.attn.c_k.weight.q"), Some((1, 0)));
    assert_eq!(route("blocks.12.attn.c_q.weight.q"), Some((2, 12)));
    assert_eq!(route("blocks.3.attn.c_v.weight.q"), Some((3, 3)));
    assert_eq!(route("blocks.3.attn.proj.weight.q"), Some((4, 3)));
    assert_eq!(route("blocks.3.mlp.fc.weight.q"), Some((5, 3)));
    assert_eq!(route("blocks.10.mlp.proj.weight.q"), Some((6, 10)));
    for other in [
        "tok_emb.weight.scale",
        "blocks.0.mlp.fc.weight.lqer_a",
        "lm_head.weight.q",
        "blocks.x.mlp.fc.weight.q",
        "blocks..mlp.fc.weight.q",
        "blocks.0.tok_emb.weight.q",
        "blocks.0.attn.attn_gate_w.q",
        "blocks.0.mlp.fc.weight",
        "x.blocks.0.mlp.fc.weight.q",
    ] {
        assert_eq!(route(other), None, "{other}");
    }
}

#[test]
fn similarity_order_is_a_permutation_that_puts_identical_rows_together() {
    // A small case by hand: from row 0 the nearest is row 2 (L1 2), then row 3, then row 1.
    let m: Vec<i8> = vec![0, 0, 10, 10, 1, 1, 9, 9];
    assert_eq!(similarity_order(&m, 4, 2), [0, 2, 3, 1]);
    // Ties go to the lowest index (rows 1, 2 and 3 are all 4 from row 0), identical rows follow.
    assert_eq!(similarity_order(&[5, 1, 9, 1], 4, 1), [0, 1, 3, 2]);
    assert_eq!(similarity_order(&[], 0, 3), Vec::<u32>::new());
    assert_eq!(similarity_order(&[7, 7], 1, 2), [0]);
    // 2 x 60 distinct random rows, each twice at random places; both the sequential scan and
    // the parallel one (wide rows) put each twin right after the other.
    for cols in [16usize, 2048] {
        let mut rng = fastrand::Rng::with_seed(cols as u64);
        let distinct: Vec<Vec<i8>> = (0..60).map(|_| (0..cols).map(|_| rng.i8(-31..=31)).collect()).collect();
        let mut rows: Vec<usize> = (0..120).map(|k| k / 2).collect();
        rng.shuffle(&mut rows);
        let m: Vec<i8> = rows.iter().flat_map(|&r| distinct[r].clone()).collect();
        let order = similarity_order(&m, rows.len(), cols);
        check_permutation(&order, rows.len()).unwrap();
        assert_eq!(order[0], 0);
        for pair in order.chunks(2) {
            assert_eq!(rows[pair[0] as usize], rows[pair[1] as usize], "cols {cols}: {order:?}");
        }
    }
}

#[test]
fn columns_round_trip_with_and_without_an_order() {
    let m: Vec<u8> = (0..12).collect();
    let mut out = vec![99];
    write_columns(&m, 3, 4, None, &mut out);
    assert_eq!(out, [99, 0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
    assert_eq!(read_columns(&out[1..], 3, 4, None), m);
    let order = [2u32, 0, 1];
    let mut out = Vec::new();
    write_columns(&m, 3, 4, Some(&order), &mut out);
    assert_eq!(out[..3], [8, 0, 4]);
    assert_eq!(read_columns(&out, 3, 4, Some(&order)), m);
}

/// The split into streams and the join back, without lrzip: byte for byte, the groups and the
/// permutations where the record puts them.
#[test]
fn split_and_join_give_the_container_back_byte_for_byte() {
    let model = small_model();
    let container = quantized(&model, 1).serialize().unwrap();
    // safetensors writes the same bytes for the same tensors: what byte-exactness rests on.
    assert_eq!(quantized(&model, 1).serialize().unwrap(), container);
    for stride in [0u8, 2] {
        let streams = split(&container, stride).unwrap();
        let ids: Vec<u8> = streams.iter().map(|s| s.0).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4, 5, 6, 7, 8], "stride {stride}");
        assert_eq!(streams[0].1.starts_with(b"BSHF"), stride != 0);
        // One u16 per row of each sorted matrix: the embedding, then c_q and fc per layer.
        let (v, d, l, h) = (model.vocab_size, model.model_dim, model.num_layers, model.mlp_mult * model.model_dim);
        assert_eq!(streams[1].1.len(), 2 * (v + l * d + l * h));
        // Group `mlp.fc`: the layers' matrices, all their values.
        assert_eq!(streams[7].1.len(), l * h * d);
        assert_eq!(join(&streams).unwrap(), container);
    }
    // The embedding's permutation is stored and undone: its repeated rows are side by side.
    let streams = split(&container, 0).unwrap();
    let perm: Vec<u16> = streams[1].1[..2 * model.vocab_size].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
    let order: Vec<u32> = perm.iter().map(|&i| u32::from(i)).collect();
    check_permutation(&order, model.vocab_size).unwrap();
    assert_ne!(order, (0..model.vocab_size as u32).collect::<Vec<_>>());
    let st = SafeTensors::deserialize(&container).unwrap();
    let emb = st.tensor("tok_emb.weight.q").unwrap();
    let row = |i: u32| &emb.data()[i as usize * model.model_dim..(i as usize + 1) * model.model_dim];
    let twins = order.windows(2).filter(|w| row(w[0]) == row(w[1])).count();
    assert!(twins >= 30, "{twins} identical neighbours");
    // A wrong permutation (a row twice) is refused, naming the tensor.
    let mut bad = streams.clone();
    let first = [bad[1].1[0], bad[1].1[1]];
    bad[1].1[2..4].copy_from_slice(&first);
    let err = format!("{:#}", join(&bad).unwrap_err());
    assert!(err.contains("`tok_emb.weight.q`") && err.contains("twice"), "{err}");
    // A group cut short is refused, naming it.
    let mut bad = streams.clone();
    bad[7].1.pop();
    let err = format!("{:#}", join(&bad).unwrap_err());
    assert!(err.contains("group `mlp.fc`"), "{err}");
}

/// A container with nothing to group packs without lrzip (the remainder alone).
#[test]
fn a_container_without_groups_needs_no_lrzip() {
    let t = Tensor::from_vec(vec![1f32, -2.0, 3.0, 0.5], (2, 2), &Device::Cpu).unwrap();
    let qz = quantize(&[("other.weight".to_string(), t)], &QuantConfig::default(), Rounding::Nearest).unwrap();
    let container = qz.serialize().unwrap();
    let packed = pack(&container, 2, 9).unwrap();
    assert_eq!(stream_sizes(&packed).unwrap().len(), 1);
    assert_eq!(unpack(&packed).unwrap(), container);
    let err = pack(&container, 0, 0).unwrap_err().to_string();
    assert!(err.contains("level 0"), "{err}");
}

/// A container that safetensors would write otherwise (here: header padding it does not add)
/// is refused rather than given back different.
#[test]
fn a_container_not_in_canonical_form_is_refused() {
    let container = quantized(&small_model(), 2).serialize().unwrap();
    let n = u64::from_le_bytes(container[..8].try_into().unwrap()) as usize;
    let mut padded = (n as u64 + 8).to_le_bytes().to_vec();
    padded.extend_from_slice(&container[8..8 + n]);
    padded.extend_from_slice(b"        ");
    padded.extend_from_slice(&container[8 + n..]);
    SafeTensors::deserialize(&padded).unwrap();
    let err = format!("{:#}", split(&padded, 2).unwrap_err());
    assert!(err.contains("byte for byte"), "{err}");
    let err = format!("{:#}", split(b"not a container", 2).unwrap_err());
    assert!(err.contains("does not parse"), "{err}");
}

/// The whole artifact: `Quantized::compress` with `Codec::Pergroup`, read back by `from_bytes`.
#[test]
fn an_artifact_written_with_pergroup_reads_back() {
    let Some(_) = installed_or_skip("an_artifact_written_with_pergroup_reads_back") else { return };
    let qz = quantized(&ModelConfig { num_layers: 1, ..small_model() }, 4);
    let art = qz.compress(Codec::Pergroup, None, 2).unwrap();
    assert_eq!(art.bytes[5], 4);
    assert_eq!((art.stats.codec, art.stats.level), (Codec::Pergroup, 9));
    assert_eq!(art.stats.compressed_bytes, art.bytes.len() as u64);
    // The header's body is the container itself (the codec shuffles its own remainder).
    let body_len = u64::from_le_bytes(art.bytes[10..18].try_into().unwrap());
    assert_eq!(body_len, art.stats.serialized_bytes);
    assert!(art.bytes[HEADER_LEN..].starts_with(&MAGIC));
    assert_eq!(from_bytes(&art.bytes).unwrap(), qz);
    // The codec's own entry points take a container too.
    let container = tiny_container();
    let body = Codec::Pergroup.compress(&container, 5).unwrap();
    assert_eq!(Codec::Pergroup.decompress(&body, container.len()).unwrap(), container);
    assert!(Codec::Pergroup.decompress(&body, container.len() + 1).is_err());
    // A corrupted group, through the artifact reader: refused, naming it.
    let sizes = stream_sizes(&art.bytes[HEADER_LEN..]).unwrap();
    let k = sizes.iter().position(|s| s.0 == "group `mlp.fc`").unwrap();
    let at = HEADER_LEN + HEAD_LEN + ENTRY_LEN * sizes.len() + sizes[..k].iter().map(|s| s.2 as usize).sum::<usize>();
    let mut bad = art.bytes.clone();
    bad[at + sizes[k].2 as usize / 2] ^= 0x33;
    let err = format!("{:#}", from_bytes(&bad).unwrap_err());
    assert!(err.contains("group `mlp.fc`"), "{err}");
}

/// Truncated, corrupted and foreign bodies are errors that name the stream (the group).
#[test]
fn bad_bodies_are_refused_naming_the_stream() {
    let Some(_) = installed_or_skip("bad_bodies_are_refused_naming_the_stream") else { return };
    let container = tiny_container();
    let good = pack(&container, 2, 9).unwrap();
    assert_eq!(unpack(&good).unwrap(), container);
    // Deterministic.
    assert_eq!(pack(&container, 2, 9).unwrap(), good);
    let sizes = stream_sizes(&good).unwrap();
    let n = good.len();
    for cut in [0, 3, 5, 6, 30, HEAD_LEN + ENTRY_LEN * sizes.len(), n / 2, n - 1] {
        let err = format!("{:#}", unpack(&good[..cut]).unwrap_err());
        assert!(err.contains("truncated"), "cut {cut}: {err}");
    }
    let mut longer = good.clone();
    longer.push(0);
    assert!(format!("{:#}", unpack(&longer).unwrap_err()).contains("extended"));
    // Where each stream's packed bytes start.
    let mut at = HEAD_LEN + ENTRY_LEN * sizes.len();
    let mut starts = Vec::new();
    for (_, _, packed) in &sizes {
        starts.push(at);
        at += *packed as usize;
    }
    for (k, (name, _, packed)) in sizes.iter().enumerate() {
        // A flipped byte in the middle of the stream.
        let mut bad = good.clone();
        bad[starts[k] + *packed as usize / 2] ^= 0x5a;
        let err = format!("{:#}", unpack(&bad).unwrap_err());
        assert!(err.contains(name.as_str()) && err.contains(&format!("stream {} of 9", k + 1)), "{name}: {err}");
        // A wrong checksum in the table.
        let mut bad = good.clone();
        bad[HEAD_LEN + ENTRY_LEN * k + 17] ^= 1;
        let err = format!("{:#}", unpack(&bad).unwrap_err());
        assert!(err.contains(name.as_str()) && err.contains("checksum"), "{name}: {err}");
    }
    // Foreign bodies.
    for foreign in [b"PGQZ and more bytes".to_vec(), vec![0u8; 100], Codec::Brotli.compress(&container, 5).unwrap()] {
        let err = format!("{:#}", unpack(&foreign).unwrap_err());
        assert!(err.contains("not a pergroup body"), "{err}");
    }
    let mut bad = good.clone();
    bad[4] = 9;
    assert!(format!("{:#}", unpack(&bad).unwrap_err()).contains("version 9"));
    let mut bad = good.clone();
    bad[HEAD_LEN + ENTRY_LEN] = 0;
    assert!(format!("{:#}", unpack(&bad).unwrap_err()).contains("increasing order"));
}

/// Pergroup against Brotli (quality 11, byte shuffle 2) on the same int6 container, both read
/// back (the header's checksum is the container's: byte for byte); prints the sizes and times.
#[test]
fn smaller_than_brotli_on_a_realistic_int6_container() {
    let Some(_) = installed_or_skip("smaller_than_brotli_on_a_realistic_int6_container") else { return };
    let qz = quantized(&small_model(), 6);
    let t0 = Instant::now();
    let brotli = qz.compress(Codec::Brotli, None, 2).unwrap();
    let brotli_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let pergroup = qz.compress(Codec::Pergroup, None, 2).unwrap();
    let pack_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    assert_eq!(from_bytes(&pergroup.bytes).unwrap(), qz);
    let unpack_s = t0.elapsed().as_secs_f64();
    let (b, p) = (brotli.stats.compressed_bytes, pergroup.stats.compressed_bytes);
    println!(
        "container {} bytes: brotli {b} bytes ({brotli_s:.2}s), pergroup {p} bytes ({pack_s:.2}s, read back {unpack_s:.2}s): {} bytes ({:.2}%) smaller",
        brotli.stats.serialized_bytes,
        b as i64 - p as i64,
        100.0 * (b as f64 - p as f64) / b as f64
    );
    let sizes = stream_sizes(&pergroup.bytes[HEADER_LEN..]).unwrap();
    for (name, raw, packed) in &sizes {
        println!("  {name}: {raw} -> {packed} bytes");
    }
    let names: Vec<&str> = sizes.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(names[..3], ["the remainder", "the permutations", "group `tok_emb`"]);
    assert_eq!(names.len(), 9);
    assert!(p < b, "pergroup {p} >= brotli {b}");
}

/// The record's shapes (vocabulary 8192, 11 layers of width 512, 4x MLP, 8 heads, 4 KV heads):
/// the similarity sort's time, and pergroup against Brotli with their times. Minutes on 2 cores:
/// `cargo test --release --lib artifact::pergroup::tests::record_shapes -- --ignored --nocapture`.
#[test]
#[ignore = "slow: packs a record-sized container (36 MB of int8 values) through lrzip"]
fn record_shapes() {
    let model = ModelConfig {
        vocab_size: 8192,
        num_layers: 11,
        model_dim: 512,
        num_heads: 8,
        num_kv_heads: 4,
        mlp_mult: 4,
        ..ModelConfig::default()
    };
    let qz = quantized(&model, 7);
    let container = qz.serialize().unwrap();
    let t0 = Instant::now();
    split(&container, 2).unwrap();
    println!("container {} bytes; split (sort, transpose, check) {:.1}s", container.len(), t0.elapsed().as_secs_f64());
    let Some(_) = installed_or_skip("record_shapes") else { return };
    let t0 = Instant::now();
    let brotli = qz.compress(Codec::Brotli, None, 2).unwrap().stats.compressed_bytes;
    println!("brotli {brotli} bytes in {:.1}s", t0.elapsed().as_secs_f64());
    let t0 = Instant::now();
    let packed = pack(&container, 2, 9).unwrap();
    let pack_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    assert_eq!(unpack(&packed).unwrap(), container);
    println!("pergroup {} bytes in {pack_s:.1}s, unpacked in {:.1}s", packed.len(), t0.elapsed().as_secs_f64());
}

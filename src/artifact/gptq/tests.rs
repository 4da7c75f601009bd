//! Tests of [`super`].

use super::solver::{Block, block_tile_kernel};
use super::*;
use crate::artifact::synthetic::{correlated_hessian, normal};

/// Weights with std `std`, row by row a little different in size.
fn random_weights(rows: usize, cols: usize, std: f64, seed: u64) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut w = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let row_std = std * (0.5 + rng.f64());
        w.extend((0..cols).map(|_| (normal(&mut rng) * row_std) as f32));
    }
    w
}

/// SD-clip scales as f32.
fn scales_f32(w: &[f32], rows: usize, cols: usize, qmax: i8, k: f64) -> Vec<f32> {
    sd_clip_scales(w, rows, cols, qmax, k).iter().map(|s| s.to_f32()).collect()
}

/// Lower Cholesky factor of a dense symmetric matrix, plain loops; `None` if not positive
/// definite.
#[allow(clippy::needless_range_loop)] // index loops on purpose: the textbook formulas
fn naive_cholesky(a: &[Vec<f64>]) -> Option<Vec<Vec<f64>>> {
    let n = a.len();
    let mut l = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in 0..=i {
            let mut s = a[i][j];
            for k in 0..j {
                s -= l[i][k] * l[j][k];
            }
            if i == j {
                if s.is_nan() || s <= 0.0 {
                    return None;
                }
                l[i][i] = s.sqrt();
            } else {
                l[i][j] = s / l[j][j];
            }
        }
    }
    Some(l)
}

/// `A^-1 = L^-T L^-1` from the lower Cholesky factor `L`, plain loops.
#[allow(clippy::needless_range_loop)] // index loops on purpose: the textbook formulas
fn naive_cholesky_inverse(l: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let n = l.len();
    // M = L^-1 by forward substitution, column by column.
    let mut m = vec![vec![0.0; n]; n];
    for c in 0..n {
        for i in c..n {
            let mut s = if i == c { 1.0 } else { 0.0 };
            for k in c..i {
                s -= l[i][k] * m[k][c];
            }
            m[i][c] = s / l[i][i];
        }
    }
    let mut inv = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in 0..n {
            inv[i][j] = (0..n).map(|k| m[k][i] * m[k][j]).sum();
        }
    }
    inv
}

/// GPTQ straight from the spec's steps, f64, plain loops, no faer.
#[allow(clippy::needless_range_loop)] // index loops on purpose: the spec's formulas
fn reference(w: &[f32], rows: usize, cols: usize, hessian: &[f32], scales: &[f32], qmax: i8, cfg: &GptqConfig) -> Vec<i8> {
    let n = cols;
    let mut h: Vec<Vec<f64>> =
        (0..n).map(|i| (0..n).map(|j| 0.5 * (f64::from(hessian[i * n + j]) + f64::from(hessian[j * n + i]))).collect()).collect();
    let mut wk: Vec<Vec<f64>> = (0..rows).map(|r| (0..n).map(|c| f64::from(w[r * n + c])).collect()).collect();
    // 1. dead columns
    for j in 0..n {
        if h[j][j] == 0.0 {
            h[j][j] = 1.0;
            for row in wk.iter_mut() {
                row[j] = 0.0;
            }
        }
    }
    // 2. damping
    let mean = (0..n).map(|j| h[j][j]).sum::<f64>() / n as f64;
    for (j, row) in h.iter_mut().enumerate() {
        row[j] += cfg.damping * mean;
    }
    // 3. order: insertion sort by diag descending (stable: only strictly larger moves up)
    let mut perm: Vec<usize> = (0..n).collect();
    if cfg.act_order {
        for i in 1..n {
            let mut k = i;
            while k > 0 && h[perm[k]][perm[k]] > h[perm[k - 1]][perm[k - 1]] {
                perm.swap(k, k - 1);
                k -= 1;
            }
        }
    }
    let hp: Vec<Vec<f64>> = (0..n).map(|i| (0..n).map(|j| h[perm[i]][perm[j]]).collect()).collect();
    let mut wp: Vec<Vec<f64>> = wk.iter().map(|row| perm.iter().map(|&c| row[c]).collect()).collect();
    // 4. U = upper Cholesky factor of H^-1
    let l = naive_cholesky(&hp).expect("reference: H not PD");
    let hinv = naive_cholesky_inverse(&l);
    let l2 = naive_cholesky(&hinv).expect("reference: H^-1 not PD");
    let u = |i: usize, j: usize| l2[j][i];
    // 5. blocks
    let mut qp = vec![vec![0i8; n]; rows];
    let mut b0 = 0;
    while b0 < n {
        let b1 = (b0 + cfg.block_size).min(n);
        let mut e = vec![vec![0.0; b1 - b0]; rows];
        for j in b0..b1 {
            for r in 0..rows {
                let s = f64::from(scales[r]);
                let wj = wp[r][j];
                let q = if s > 0.0 { (wj / s).round_ties_even().clamp(-f64::from(qmax), f64::from(qmax)) } else { 0.0 };
                qp[r][j] = q as i8;
                let err = (wj - q * s) / u(j, j);
                e[r][j - b0] = err;
                for k in j..b1 {
                    wp[r][k] -= err * u(j, k);
                }
            }
        }
        for r in 0..rows {
            for k in b1..n {
                let mut acc = 0.0;
                for j in b0..b1 {
                    acc += e[r][j - b0] * u(j, k);
                }
                wp[r][k] -= acc;
            }
        }
        b0 = b1;
    }
    // 6. original order
    let mut q = vec![0i8; rows * n];
    for r in 0..rows {
        for (k, &c) in perm.iter().enumerate() {
            q[r * n + c] = qp[r][k];
        }
    }
    q
}

fn cfg(block_size: usize, act_order: bool) -> GptqConfig {
    GptqConfig { block_size, act_order, ..GptqConfig::default() }
}

#[test]
fn matches_reference_on_random_matrices() {
    let mut checked = 0;
    for (i, &(rows, cols)) in [(5usize, 40usize), (33, 300), (64, 257)].iter().enumerate() {
        let h = correlated_hessian(cols, 2 * cols, 100 + i as u64);
        let w = random_weights(rows, cols, 0.02, 200 + i as u64);
        for qmax in [31i8, 127] {
            let k = if qmax == 31 { 12.85 } else { 20.0 };
            let s = scales_f32(&w, rows, cols, qmax, k);
            for block_size in [128, 16] {
                for act_order in [true, false] {
                    let c = cfg(block_size, act_order);
                    let got = quantize_matrix(&w, rows, cols, &h, &s, qmax, &c).unwrap();
                    let want = reference(&w, rows, cols, &h, &s, qmax, &c);
                    assert_eq!(got.dead_columns, 0);
                    let diff = got.q.iter().zip(&want).filter(|(a, b)| a != b).count();
                    assert_eq!(diff, 0, "{rows}x{cols} qmax {qmax} block {block_size} act_order {act_order}: {diff} values differ");
                    assert!(got.q.iter().all(|&v| v.abs() <= qmax));
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 24);
}

#[test]
fn identity_hessian_is_round_to_nearest() {
    let (rows, cols) = (17, 150);
    let w = random_weights(rows, cols, 0.02, 5);
    let mut h = vec![0.0f32; cols * cols];
    for j in 0..cols {
        h[j * cols + j] = 3.0;
    }
    for (qmax, k) in [(31i8, 12.85), (127, 20.0), (7, 3.0)] {
        let s = scales_f32(&w, rows, cols, qmax, k);
        let rtn = round_to_nearest(&w, cols, &s, qmax);
        for c in [cfg(128, true), cfg(16, false), cfg(7, true)] {
            let got = quantize_matrix(&w, rows, cols, &h, &s, qmax, &c).unwrap();
            assert_eq!(got.q, rtn, "qmax {qmax} {c:?}");
        }
        // With qmax 7 and k = 3 some values clip: the comparison covers the clamp.
        if qmax == 7 {
            assert!(rtn.iter().any(|&v| v.abs() == 7));
        }
    }
}

#[test]
fn act_order_permutes() {
    let (rows, cols) = (24, 96);
    let h = correlated_hessian(cols, 300, 31);
    let w = random_weights(rows, cols, 0.02, 32);
    let s = scales_f32(&w, rows, cols, 31, 12.85);
    let on = quantize_matrix(&w, rows, cols, &h, &s, 31, &cfg(32, true)).unwrap().q;
    let off = quantize_matrix(&w, rows, cols, &h, &s, 31, &cfg(32, false)).unwrap().q;
    assert_ne!(on, off, "act-order on and off gave the same q");
    assert_eq!(on, reference(&w, rows, cols, &h, &s, 31, &cfg(32, true)));
    assert_eq!(off, reference(&w, rows, cols, &h, &s, 31, &cfg(32, false)));
    // The order really is by decreasing diagonal, stable on ties.
    assert_eq!(column_order(&[1.0, 3.0, 2.0, 3.0, 0.5], true), vec![1, 3, 2, 0, 4]);
    assert_eq!(column_order(&[1.0, 3.0, 2.0], false), vec![0, 1, 2]);
}

#[test]
fn dead_columns_get_zero() {
    let (rows, cols) = (20, 64);
    let mut h = correlated_hessian(cols, 200, 41);
    let dead = [0usize, 17, 63];
    for &j in &dead {
        for k in 0..cols {
            h[j * cols + k] = 0.0;
            h[k * cols + j] = 0.0;
        }
    }
    // Large weights in the dead columns: they must not leak into q or the other columns.
    let mut w = random_weights(rows, cols, 0.02, 42);
    for r in 0..rows {
        for &j in &dead {
            w[r * cols + j] = 0.5;
        }
    }
    let s = scales_f32(&w, rows, cols, 31, 12.85);
    for c in [cfg(128, true), cfg(16, false)] {
        let out = quantize_matrix(&w, rows, cols, &h, &s, 31, &c).unwrap();
        assert_eq!(out.dead_columns, dead.len());
        for r in 0..rows {
            for &j in &dead {
                assert_eq!(out.q[r * cols + j], 0, "row {r}, dead column {j}");
            }
        }
        assert_eq!(out.q, reference(&w, rows, cols, &h, &s, 31, &c));
        let err = weighted_error(&w, rows, cols, &h, &out.q, &s);
        assert!(err.is_finite() && err < 1.0, "weighted error {err}");
    }
}

#[test]
fn gptq_beats_round_to_nearest_on_correlated_hessian() {
    let (rows, cols) = (64, 256);
    let h = correlated_hessian(cols, 1024, 51);
    let w = random_weights(rows, cols, 0.02, 52);
    for (qmax, k) in [(31i8, 12.85), (127, 20.0)] {
        let s = scales_f32(&w, rows, cols, qmax, k);
        let gptq = quantize_matrix(&w, rows, cols, &h, &s, qmax, &GptqConfig::default()).unwrap().q;
        let rtn = round_to_nearest(&w, cols, &s, qmax);
        let (eg, er) = (weighted_error(&w, rows, cols, &h, &gptq, &s), weighted_error(&w, rows, cols, &h, &rtn, &s));
        assert!(eg.is_finite() && er.is_finite() && er > 0.0);
        assert!(eg < 0.8 * er, "qmax {qmax}: GPTQ {eg:.3e} vs round-to-nearest {er:.3e}");
    }
}

#[test]
fn wide_and_baseline_kernels_agree() {
    // The dispatcher (the AVX2 version where the CPU has it) and the kernel as compiled for
    // the baseline target give the same bits. A tile of 20 rows of a 48-column working matrix,
    // block columns 8..40 (nb = 32), U a random upper-triangular block with a positive diagonal.
    let (rt, n, bs, b0, nb) = (20usize, 48usize, 32usize, 8usize, 32usize);
    let mut rng = fastrand::Rng::with_seed(81);
    let w: Vec<f64> = (0..rt * n).map(|_| normal(&mut rng) * 0.02).collect();
    let s: Vec<f32> = (0..rt).map(|r| if r == 3 { 0.0 } else { 0.001 + 0.002 * rng.f32() }).collect();
    let ublk: Vec<f64> = (0..nb * nb)
        .map(|i| match (i / nb, i % nb) {
            (j, k) if k < j => 0.0,
            (j, k) if k == j => 0.5 + rng.f64() + j as f64 * 0.01,
            _ => 0.3 * normal(&mut rng),
        })
        .collect();
    let blk = Block { n, bs, b0, nb, ublk: &ublk, qmax: 31.0 };
    let (mut q1, mut e1) = (vec![0i8; rt * n], vec![0.0f64; rt * bs]);
    let (mut q2, mut e2) = (vec![0i8; rt * n], vec![0.0f64; rt * bs]);
    quantize_block_tile(blk, &w, &mut q1, &mut e1, &s);
    block_tile_kernel(blk, &w, &mut q2, &mut e2, &s);
    assert_eq!(q1, q2);
    assert_eq!(e1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), e2.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    assert!(q1.iter().any(|&v| v != 0) && e1.iter().any(|&v| v != 0.0));
    assert!((0..n).all(|c| q1[3 * n + c] == 0), "the zero-scale row");
}

#[test]
fn row_major_view_layout() {
    // 2 x 3 view with rows 5 apart, starting at offset 1.
    let mut buf: Vec<f64> = (0..12).map(f64::from).collect();
    let mut v = row_major_mut(&mut buf[1..], 2, 3, 5);
    assert_eq!((v.nrows(), v.ncols()), (2, 3));
    assert_eq!((v[(0, 2)], v[(1, 0)], v[(1, 2)]), (3.0, 6.0, 8.0));
    v[(1, 1)] = -1.0;
    assert_eq!(buf[7], -1.0);
}

#[test]
fn weighted_error_by_hand() {
    // W = [[1, 2]], s = 1, q = [[1, 1]]: D = [[0, 1]]; H = [[2, 1], [1, 3]].
    // D H D^T = 3; W H W^T = 2 + 2*2*1 + 4*3 = 18.
    let e = weighted_error(&[1.0, 2.0], 1, 2, &[2.0, 1.0, 1.0, 3.0], &[1, 1], &[1.0]);
    assert!((e - 3.0 / 18.0).abs() < 1e-15, "{e}");
}

#[test]
fn sd_clip_scales_by_hand() {
    // Row [1, 2, 3, 4]: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5,
    // unbiased variance 5/3, std 1.2909944; k = 12.85, Q = 31: s = 0.53513 -> fp16 0.53515625
    // (0x3848: 1.0703125 * 2^-1; fp16 spacing there is 2^-11 = 0.00049, the neighbours
    // 0.5346680 and 0.5356445 are farther).
    // Row [-0.02, 0.02]: mean 0, variance 0.0008 / 1, std 0.028284; k = 20, Q = 127:
    // s = 0.0044542 -> fp16 0.004455566 (0x1C90).
    // A constant row has std 0: clamped to 1e-10, which rounds to fp16 zero.
    let w = [1.0f32, 2.0, 3.0, 4.0];
    let s = sd_clip_scales(&w, 1, 4, 31, 12.85);
    assert_eq!(s, vec![f16::from_bits(0x3848)]);
    assert!((f64::from(s[0].to_f32()) - 0.53515625).abs() < 1e-12);
    let s = sd_clip_scales(&[-0.02f32, 0.02], 1, 2, 127, 20.0);
    assert_eq!(s, vec![f16::from_bits(0x1C90)]);
    let s = sd_clip_scales(&[0.25f32; 8], 2, 4, 31, 12.85);
    assert_eq!(s, vec![f16::from_f32(1e-10); 2]);
    assert_eq!(s[0].to_f32(), 0.0);
    // A zero-scale row quantizes to 0 in both quantizers.
    let h: Vec<f32> = (0..16).map(|i| if i % 5 == 0 { 1.0 } else { 0.0 }).collect();
    let sf: Vec<f32> = s.iter().map(|v| v.to_f32()).collect();
    assert_eq!(quantize_matrix(&[0.25f32; 8], 2, 4, &h, &sf, 31, &GptqConfig::default()).unwrap().q, vec![0; 8]);
    assert_eq!(round_to_nearest(&[0.25f32; 8], 4, &sf, 31), vec![0; 8]);
}

#[test]
fn round_to_nearest_ties_and_clamp() {
    // w / s = 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, 100 -> 31, -100 -> -31.
    let q = round_to_nearest(&[2.5, 3.5, -2.5, 100.0, -100.0], 5, &[1.0], 31);
    assert_eq!(q, vec![2, 4, -2, 31, -31]);
}

#[test]
fn bad_inputs_are_errors() {
    let (rows, cols) = (3, 4);
    let w = random_weights(rows, cols, 0.02, 61);
    let mut h = vec![0.0f32; cols * cols];
    for j in 0..cols {
        h[j * cols + j] = 1.0;
    }
    let s = vec![0.001f32; rows];
    let c = GptqConfig::default();
    let run = |w: &[f32], h: &[f32], s: &[f32], qmax: i8, c: &GptqConfig| quantize_matrix(w, rows, cols, h, s, qmax, c);
    assert!(run(&w, &h, &s, 31, &c).is_ok());

    let msg = |r: Result<GptqOutput>| format!("{:#}", r.unwrap_err());
    let mut bad_w = w.clone();
    bad_w[5] = f32::NAN;
    assert!(msg(run(&bad_w, &h, &s, 31, &c)).contains("non-finite weight"));
    bad_w[5] = f32::INFINITY;
    assert!(msg(run(&bad_w, &h, &s, 31, &c)).contains("row 1, column 1"));
    let mut bad_h = h.clone();
    bad_h[6] = f32::NEG_INFINITY;
    assert!(msg(run(&w, &bad_h, &s, 31, &c)).contains("non-finite Hessian"));
    assert!(msg(run(&w[1..], &h, &s, 31, &c)).contains("weight has 11 values"));
    assert!(msg(run(&w, &h[1..], &s, 31, &c)).contains("Hessian has 15 values"));
    assert!(msg(run(&w, &h, &s[1..], 31, &c)).contains("2 row scales"));
    assert!(msg(run(&w, &h, &[0.001, f32::NAN, 0.001], 31, &c)).contains("row 1 has scale"));
    assert!(msg(run(&w, &h, &[0.001, -0.001, 0.001], 31, &c)).contains("row 1 has scale"));
    assert!(msg(run(&w, &h, &s, 0, &c)).contains("qmax"));
    assert!(msg(run(&w, &h, &s, -5, &c)).contains("qmax"));
    assert!(msg(run(&w, &h, &s, 31, &GptqConfig { block_size: 0, ..c })).contains("block_size"));
    assert!(msg(run(&w, &h, &s, 31, &GptqConfig { damping: f64::NAN, ..c })).contains("damping"));

    // Not positive definite: a negative diagonal (the damping is negative too), and an
    // indefinite matrix with a positive diagonal.
    let mut neg = h.clone();
    for j in 0..cols {
        neg[j * cols + j] = -1.0;
    }
    assert!(msg(run(&w, &neg, &s, 31, &c)).contains("not positive definite"));
    let mut indef = h.clone();
    indef[1] = 3.0;
    indef[cols] = 3.0;
    assert!(msg(run(&w, &indef, &s, 31, &c)).contains("not positive definite"));
}

#[test]
fn empty_shapes() {
    let out = quantize_matrix(&[], 0, 3, &[1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], &[], 31, &GptqConfig::default()).unwrap();
    assert_eq!(out, GptqOutput { q: vec![], dead_columns: 1 });
    let out = quantize_matrix(&[], 2, 0, &[], &[1.0, 1.0], 31, &GptqConfig::default()).unwrap();
    assert_eq!(out, GptqOutput { q: vec![], dead_columns: 0 });
}

/// GPTQ of all 67 matrices of the 2026-04-09 record: 11 layers x (c_q 512x512, c_k 256x512,
/// c_v 256x512, attn.proj 512x512, mlp.fc 2048x512, mlp.proj 512x2048), int6 with SD-clip
/// k = 12.85, and tok_emb 8192x512, int8 with k = 20. Random weights (std 0.02) and one
/// correlated `H = X^T X / 4096` per input width (the time does not depend on the values).
/// Prints the total time of `quantize_matrix` (and of the scales), per matrix kind, and
/// GPTQ's weighted error relative to round-to-nearest's for layer 0 and the embedding.
#[test]
#[ignore = "timing; run: cargo test --release --lib gptq::tests::record_matrices_time -- --ignored --nocapture"]
fn record_matrices_time() {
    use std::time::Instant;
    let h512 = correlated_hessian(512, 4096, 71);
    let h2048 = correlated_hessian(2048, 4096, 72);
    let block =
        [("c_q", 512, 512), ("c_k", 256, 512), ("c_v", 256, 512), ("attn.proj", 512, 512), ("mlp.fc", 2048, 512), ("mlp.proj", 512, 2048)];
    let mut jobs: Vec<(String, &str, usize, usize, i8, f64)> = Vec::new();
    for layer in 0..11 {
        for &(kind, rows, cols) in &block {
            jobs.push((format!("blocks.{layer}.{kind}"), kind, rows, cols, 31, 12.85));
        }
    }
    jobs.push(("tok_emb".into(), "tok_emb", 8192, 512, 127, 20.0));
    assert_eq!(jobs.len(), 67);

    let mut rng = fastrand::Rng::with_seed(73);
    let (mut total, mut total_scales) = (0.0f64, 0.0f64);
    let mut per_kind: Vec<(&str, f64, usize)> = Vec::new();
    for (name, kind, rows, cols, qmax, k) in &jobs {
        let w: Vec<f32> = (0..rows * cols).map(|_| (normal(&mut rng) * 0.02) as f32).collect();
        let h = if *cols == 2048 { &h2048 } else { &h512 };
        let t = Instant::now();
        let s: Vec<f32> = sd_clip_scales(&w, *rows, *cols, *qmax, *k).iter().map(|v| v.to_f32()).collect();
        total_scales += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let out = quantize_matrix(&w, *rows, *cols, h, &s, *qmax, &GptqConfig::default()).unwrap();
        let dt = t.elapsed().as_secs_f64();
        total += dt;
        if let Some(e) = per_kind.iter_mut().find(|e| e.0 == *kind) {
            e.1 += dt;
            e.2 += 1;
        } else {
            per_kind.push((kind, dt, 1));
        }
        if name.starts_with("blocks.0.") || name == "tok_emb" {
            let rtn = round_to_nearest(&w, *cols, &s, *qmax);
            let (eg, er) = (weighted_error(&w, *rows, *cols, h, &out.q, &s), weighted_error(&w, *rows, *cols, h, &rtn, &s));
            println!("{name:<18} {rows:>5}x{cols:<5} {dt:>7.3} s  weighted error GPTQ {eg:.3e}, RTN {er:.3e} ({:.3}x)", eg / er);
        }
    }
    for (kind, t, count) in &per_kind {
        println!("{kind:<10} {count:>2} matrices {t:>8.3} s ({:.3} s each)", t / *count as f64);
    }
    println!("rayon threads: {}", rayon::current_num_threads());
    println!("67 matrices: GPTQ {total:.2} s, SD-clip scales {total_scales:.3} s");
}

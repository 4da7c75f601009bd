//! Tests of [`super`] (and helpers the phased TTT's tests share).

use std::cell::Cell;
use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::*;
use crate::eval::candle_model::CandleModel;
use crate::model::{Gpt, ModelConfig};
use crate::optim::Sgd;

pub(crate) const VOCAB: usize = 32;

/// A tiny float64 model whose parameters are all moved off their initial values (the zero
/// output projections would otherwise make attention, and so the context, irrelevant).
pub(crate) fn model() -> Gpt {
    model_with(&ModelConfig { vocab_size: VOCAB, num_layers: 2, model_dim: 16, num_heads: 2, num_kv_heads: 1, ..ModelConfig::default() })
}

/// [`model`] of another config, its parameters moved off their initial values the same way.
pub(crate) fn model_with(cfg: &ModelConfig) -> Gpt {
    let m = Gpt::new(cfg, 3, DType::F64, &Device::Cpu).unwrap();
    let mut rng = fastrand::Rng::with_seed(17);
    for (_, v, _) in m.params() {
        let old: Vec<f64> = v.flatten_all().unwrap().to_vec1().unwrap();
        let new: Vec<f64> = old.iter().map(|x| x + rng.f64() * 0.6 - 0.3).collect();
        v.set(&Tensor::from_vec(new, v.dims(), &Device::Cpu).unwrap()).unwrap();
    }
    m
}

/// Hand-made byte tables: id 0 is a boundary (0 bytes), the others 1 to 3 bytes, every third
/// one with a leading space.
pub(crate) fn tables() -> Arc<ByteTables> {
    Arc::new(tables_of(VOCAB))
}

/// [`tables`] for `vocab` ids.
pub(crate) fn tables_of(vocab: usize) -> ByteTables {
    ByteTables {
        base_bytes: (0..vocab).map(|i| if i == 0 { 0 } else { 1 + (i % 3) as u16 }).collect(),
        leading_space: (0..vocab).map(|i| i % 3 == 0 && i > 0).collect(),
        is_boundary: (0..vocab).map(|i| i == 0).collect(),
        has_space_piece: true,
        stream_bytes: None,
        record_targets: false,
    }
}

fn random_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| rng.u32(0..VOCAB as u32)).collect()
}

fn params(m: &Gpt) -> Vec<Vec<f64>> {
    m.params().iter().map(|(_, v, _)| v.flatten_all().unwrap().to_vec1::<f64>().unwrap()).collect()
}

/// The loss of target `j` computed on its own: the window the spec's geometry gives it
/// (`ws = 0` for `j < T`, else the largest multiple of `stride` with `ws + C ≤ j`), run alone
/// and unpadded. Also returns that window's start.
fn direct_nll(m: &Gpt, tokens: &[u32], j: usize, sc: &SlidingConfig) -> (f64, usize) {
    let (t, c, n) = (sc.seq_len, sc.context(), tokens.len() - 1);
    let ws = if j < t { 0 } else { (j - c) / sc.stride * sc.stride };
    let len = (ws + t).min(n) - ws;
    let x = Tensor::from_slice(&tokens[ws..ws + len], (1, len), &Device::Cpu).unwrap();
    let y = Tensor::from_slice(&tokens[ws + 1..ws + len + 1], (1, len), &Device::Cpu).unwrap();
    let nll: Vec<f64> = m.eval_token_losses(&x, &y).unwrap().to_vec1().unwrap();
    (nll[j - ws], ws)
}

/// Per-target losses from the sliding scorer (each target must be scored exactly once).
fn sliding_losses(m: &Gpt, tokens: &[u32], sc: &SlidingConfig) -> Vec<f32> {
    let n = tokens.len() - 1;
    let mut out = vec![None; n];
    let done = score_windows(&mut CandleModel::new(m), tokens, &windows(n, sc), sc, &Single, &|| true, |first, prev, tgt, nll| {
        for (k, &l) in nll.iter().enumerate() {
            assert_eq!((prev[k], tgt[k]), (tokens[first + k], tokens[first + k + 1]));
            assert!(out[first + k].replace(l).is_none(), "target {} scored twice", first + k);
        }
    })
    .unwrap();
    assert!(done);
    out.into_iter().enumerate().map(|(j, l)| l.unwrap_or_else(|| panic!("target {j} not scored"))).collect()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs()).max(1.0)
}

// ---------- geometry ----------

/// Every target scored exactly once, each with at least `C` tokens of context outside the
/// first window, and (when `N > C`) exactly the spec's window list
/// `[ws for ws in range(0, N, stride) if ws + C < N]`.
#[test]
fn windows_score_every_target_exactly_once() {
    for t in [1usize, 2, 3, 5, 8, 16] {
        for stride in 1..=t {
            let sc = SlidingConfig { seq_len: t, stride, batch_windows: 1 };
            let c = t - stride;
            for n in (0..=3 * t + 5).chain([100, 257]) {
                let wins = windows(n, &sc);
                let mut count = vec![0u32; n];
                for (i, w) in wins.iter().enumerate() {
                    assert_eq!(w.start, i * stride, "T {t} stride {stride} N {n}");
                    assert!(w.len >= 1 && w.len <= t && w.start + w.len <= n && w.score_from < w.len, "{w:?} T {t} N {n}");
                    assert_eq!(w.len, (w.start + t).min(n) - w.start);
                    if i == 0 {
                        assert_eq!(w.score_from, 0);
                    } else {
                        assert_eq!(w.score_from, c, "every later window scores [C, L)");
                    }
                    for j in w.scored() {
                        count[j] += 1;
                        if i > 0 {
                            assert!(j - w.start >= c, "target {j} has {} < C = {c} tokens of context", j - w.start);
                        }
                    }
                }
                assert!(count.iter().all(|&k| k == 1), "T {t} stride {stride} N {n}: counts {count:?}");
                if n > c {
                    let spec: Vec<usize> = (0..n).step_by(stride).filter(|ws| ws + c < n).collect();
                    assert_eq!(wins.iter().map(|w| w.start).collect::<Vec<_>>(), spec, "T {t} stride {stride} N {n}");
                } else if n > 0 {
                    assert_eq!(wins, [Window { start: 0, len: n, score_from: 0 }], "a short stream is one window");
                }
            }
        }
    }
    // The record's numbers (spec §2.5): 633,409 windows for N = 40,540,160, T = 2048, stride 64.
    assert_eq!(windows(40_540_160, &SlidingConfig::default()).len(), 633_409);
}

/// With chunk and stride dividing each other as in the record, chunk `c` scores exactly the
/// targets `[c·chunk, (c+1)·chunk)` (spec §4.7); the last chunk the rest.
#[test]
fn chunks_score_their_own_targets() {
    let cfg = TttConfig { sliding: SlidingConfig { seq_len: 2048, stride: 64, batch_windows: 32 }, ..TttConfig::default() };
    let n = 40_540_160;
    let (wins, ranges) = chunk_plan(n, &cfg);
    assert_eq!(ranges.len(), 1238);
    for (c, r) in ranges.iter().enumerate() {
        let scored = wins[r.start].scored().start..wins[r.end - 1].scored().end;
        assert_eq!(scored, 32_768 * c..(32_768 * (c + 1)).min(n), "chunk {c}");
    }
    assert_eq!(n - 32_768 * 1237, 6_144);
    // A geometry where stride does not divide the chunk: still a contiguous tiling, every
    // window in the chunk of its first scored target.
    let cfg = TttConfig { sliding: SlidingConfig { seq_len: 8, stride: 3, batch_windows: 2 }, chunk_tokens: 10, ..TttConfig::default() };
    let (wins, ranges) = chunk_plan(53, &cfg);
    assert_eq!(ranges.len(), 6);
    assert_eq!(ranges.last().unwrap().end, wins.len());
    for (c, r) in ranges.iter().enumerate() {
        for w in &wins[r.clone()] {
            assert_eq!((w.scored().start / 10).min(5), c);
        }
    }
}

#[test]
fn config_check_names_the_keys() {
    TttConfig::default().check().unwrap();
    let base = TttConfig { sliding: SlidingConfig { seq_len: 8, stride: 4, batch_windows: 2 }, chunk_tokens: 16, ..TttConfig::default() };
    base.check().unwrap();
    let err = |f: &dyn Fn(&mut TttConfig)| {
        let mut c = base.clone();
        f(&mut c);
        c.check().unwrap_err().to_string()
    };
    type Case<'a> = (&'a dyn Fn(&mut TttConfig), &'a str);
    let cases: [Case; 11] = [
        (&|c| c.sliding.seq_len = 0, "`seq_len`"),
        (&|c| c.sliding.stride = 0, "`stride`"),
        (&|c| c.sliding.stride = 9, "`stride`"),
        (&|c| c.sliding.batch_windows = 0, "`batch_windows`"),
        (&|c| c.chunk_tokens = 7, "`chunk_tokens`"),
        (&|c| c.lr = -1.0, "`lr`"),
        (&|c| c.lr = f64::NAN, "`lr`"),
        (&|c| c.momentum = 1.0, "`momentum`"),
        (&|c| c.epochs = 0, "`epochs`"),
        (&|c| c.batch_seqs = 0, "`batch_seqs`"),
        (&|c| c.grad_clip = -0.5, "`grad_clip`"),
    ];
    for (f, key) in cases {
        let e = err(f);
        assert!(e.contains(key), "{e:?} should name {key}");
    }
    // The cosine schedule: lr at chunk 0, half way in the middle, 0 at the last chunk.
    assert_eq!(base.chunk_lr(0, 5), base.lr);
    assert!((base.chunk_lr(2, 5) - base.lr / 2.0).abs() < 1e-15);
    assert!(base.chunk_lr(4, 5).abs() < 1e-15);
    assert_eq!(base.chunk_lr(0, 1), base.lr);
}

// ---------- sliding evaluation ----------

/// `stride == seq_len` is the non-overlapping evaluation: the loop of
/// `Validator::run` (consecutive sequences, other batch sizes) gives the same sums.
#[test]
fn sliding_with_full_stride_is_the_non_overlapping_eval() {
    let m = model();
    let t = 8;
    let tokens = random_tokens(7 * t + 1, 1);
    let tables = tables();
    let mut want = BpbAccumulator::new(tables.clone());
    for s in (0..7).step_by(2) {
        let rows = 2.min(7 - s);
        let (x, y) = (&tokens[s * t..(s + rows) * t], &tokens[s * t + 1..(s + rows) * t + 1]);
        let xt = Tensor::from_slice(x, (rows, t), &Device::Cpu).unwrap();
        let yt = Tensor::from_slice(y, (rows, t), &Device::Cpu).unwrap();
        let nll = m.eval_token_losses(&xt, &yt).unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        want.add(s * t, x, y, &nll);
    }
    let sc = SlidingConfig { seq_len: t, stride: t, batch_windows: 3 };
    let got = sliding_eval(&mut CandleModel::new(&m), &tokens, tables, &sc, || true).unwrap().unwrap();
    assert_eq!((got.tokens(), got.bytes()), (want.tokens(), want.bytes()));
    assert!((got.nll_sum() - want.nll_sum()).abs() < 1e-9, "{} vs {}", got.nll_sum(), want.nll_sum());
    assert!(want.tokens() == 56 && want.bytes() > 0);
}

/// With a small stride every target's loss is the one of its own window run alone and
/// unpadded (so the padding of the short last windows cannot reach a scored position), and
/// the accumulator holds exactly these losses and the bytes of every (input, target) pair.
#[test]
fn sliding_losses_match_each_targets_own_window() {
    let m = model();
    let sc = SlidingConfig { seq_len: 16, stride: 4, batch_windows: 5 };
    // N = 83: the last windows are shorter than T and padded.
    let tokens = random_tokens(84, 2);
    let n = tokens.len() - 1;
    let losses = sliding_losses(&m, &tokens, &sc);
    let mut sum = 0.0;
    for (j, &l) in losses.iter().enumerate() {
        let (want, ws) = direct_nll(&m, &tokens, j, &sc);
        assert!(close(f64::from(l), want, 1e-6), "target {j}: sliding {l}, direct {want}");
        assert!(j < sc.seq_len || j - ws >= sc.context(), "target {j} scored with {} of context", j - ws);
        sum += f64::from(l);
    }
    let acc = sliding_eval(&mut CandleModel::new(&m), &tokens, tables(), &sc, || true).unwrap().unwrap();
    assert_eq!(acc.tokens(), n as u64);
    assert_eq!(acc.bytes(), tables().count_bytes(&tokens[..n], &tokens[1..]));
    assert!(close(acc.nll_sum(), sum, 1e-12));
    // The context matters: a full-stride evaluation (context reset every T) scores differently.
    let full = sliding_eval(&mut CandleModel::new(&m), &tokens, tables(), &SlidingConfig { stride: 16, ..sc }, || true).unwrap().unwrap();
    assert!((full.nll_sum() - acc.nll_sum()).abs() > 1e-3);
}

#[test]
fn sliding_eval_stops_and_rejects_bad_tokens() {
    let m = model();
    let sc = SlidingConfig { seq_len: 8, stride: 2, batch_windows: 2 };
    let tokens = random_tokens(40, 3);
    let calls = Cell::new(0);
    let stop_after_two = || {
        calls.set(calls.get() + 1);
        calls.get() <= 2
    };
    assert!(sliding_eval(&mut CandleModel::new(&m), &tokens, tables(), &sc, stop_after_two).unwrap().is_none());
    assert_eq!(calls.get(), 3);
    let mut bad = tokens.clone();
    bad[7] = VOCAB as u32;
    let e = sliding_eval(&mut CandleModel::new(&m), &bad, tables(), &sc, || true).unwrap_err().to_string();
    assert!(e.contains("position 7"), "{e}");
    assert!(sliding_eval(&mut CandleModel::new(&m), &tokens[..1], tables(), &sc, || true).is_err());
    let e =
        sliding_eval(&mut CandleModel::new(&m), &tokens, tables(), &SlidingConfig { stride: 9, ..sc }, || true).unwrap_err().to_string();
    assert!(e.contains("`stride`"), "{e}");
}

// ---------- score-first TTT ----------

/// Chunk, stride and sequence length aligned as in the record: 6 chunks of 16 targets (the
/// last one 6), 2 training sequences per chunk, batches of 1 sequence so momentum carries
/// over several steps per chunk; the gradients are clipped.
fn aligned() -> TttConfig {
    TttConfig {
        sliding: SlidingConfig { seq_len: 8, stride: 4, batch_windows: 3 },
        chunk_tokens: 16,
        lr: 0.05,
        momentum: 0.9,
        epochs: 2,
        batch_seqs: 1,
        grad_clip: 1.0,
    }
}

/// Stride dividing neither the chunk nor the sequence length, a chunk that is not a whole
/// number of sequences: windows straddle chunk borders.
fn misaligned() -> TttConfig {
    TttConfig {
        sliding: SlidingConfig { seq_len: 6, stride: 4, batch_windows: 2 },
        chunk_tokens: 14,
        lr: 0.05,
        momentum: 0.9,
        epochs: 2,
        batch_seqs: 2,
        grad_clip: 1.0,
    }
}

fn run(tokens: &[u32], cfg: &TttConfig) -> (TttOutcome, Vec<TttEvent>, Gpt) {
    let (out, events, _, m) = run_with_snapshots(tokens, cfg);
    (out, events, m)
}

/// Weights of every parameter, in `params` order.
type Snapshot = Vec<Vec<f64>>;

/// [`run`] that also copies the model's weights at every event, as they are when it is
/// reported.
fn run_with_snapshots(tokens: &[u32], cfg: &TttConfig) -> (TttOutcome, Vec<TttEvent>, Vec<Snapshot>, Gpt) {
    let m = model();
    let (mut events, mut snaps) = (Vec::new(), Vec::new());
    let on_event = |e: &TttEvent| {
        events.push(e.clone());
        snaps.push(params(&m));
    };
    let out = score_first_ttt(&mut CandleModel::new(&m), tokens, tables(), cfg, on_event, || true).unwrap().unwrap();
    (out, events, snaps, m)
}

/// A fresh model holding the weights `snap`.
fn model_from(snap: &[Vec<f64>]) -> Gpt {
    let m = model();
    for ((_, v, _), w) in m.params().iter().zip(snap) {
        v.set(&Tensor::from_slice(w, v.dims(), &Device::Cpu).unwrap()).unwrap();
    }
    m
}

fn scored_ranges(events: &[TttEvent]) -> Vec<Range<usize>> {
    events.iter().filter_map(|e| if let TttEvent::Scored { targets, .. } = e { Some(targets.clone()) } else { None }).collect()
}

/// (c), (d), (f): the trace is S0 T0 S1 T1 … S(n−1); scored ranges tile `0..N` left to right
/// (each target once); every trained range is non-empty and inside the targets already
/// scored; no scored range meets an earlier trained range; the last chunk is never trained
/// on; the result is the sum of the scores as they were emitted (no rescoring).
#[test]
fn ttt_trace_is_score_first_single_pass() {
    for (cfg, n) in [(aligned(), 86usize), (misaligned(), 61)] {
        let tokens = random_tokens(n + 1, 4);
        let (out, events, _) = run(&tokens, &cfg);
        let n_chunks = n.div_ceil(cfg.chunk_tokens);
        assert_eq!(out.chunks, n_chunks);
        assert_eq!(events.len(), 2 * n_chunks - 1);
        let (mut scored_end, mut trained): (usize, Vec<Range<usize>>) = (0, Vec::new());
        let (mut nll, mut toks, mut bytes) = (0.0f64, 0u64, 0u64);
        let mut emitted = Vec::new();
        for (i, e) in events.iter().enumerate() {
            match e {
                TttEvent::Scored { chunk, targets, nll_sum, tokens: k, bytes: b, .. } => {
                    assert_eq!((i % 2, *chunk), (0, i / 2), "scoring of chunk {chunk} out of order");
                    assert_eq!(targets.start, scored_end, "chunk {chunk}: targets scored twice or skipped");
                    assert_eq!(*k as usize, targets.len());
                    for r in &trained {
                        assert!(
                            r.end <= targets.start || r.start >= targets.end,
                            "chunk {chunk} scores {targets:?}, trained on {r:?} before"
                        );
                    }
                    scored_end = targets.end;
                    nll += nll_sum;
                    toks += k;
                    bytes += b;
                    emitted.push((*nll_sum, *k));
                }
                TttEvent::Trained { chunk, targets, lr, steps, .. } => {
                    assert_eq!((i % 2, *chunk), (1, i / 2), "training of chunk {chunk} not right after its scoring");
                    assert!(*chunk < n_chunks - 1, "the last chunk is never trained on");
                    assert!(
                        !targets.is_empty() && targets.end <= scored_end,
                        "chunk {chunk} trains on {targets:?}, scored only < {scored_end}"
                    );
                    assert_eq!(targets.start, chunk * cfg.chunk_tokens);
                    assert_eq!(targets.len(), cfg.chunk_tokens / cfg.sliding.seq_len * cfg.sliding.seq_len);
                    assert_eq!(*lr, cfg.chunk_lr(*chunk, n_chunks));
                    let seqs = targets.len() / cfg.sliding.seq_len;
                    assert_eq!(*steps, cfg.epochs * seqs.div_ceil(cfg.batch_seqs));
                    trained.push(targets.clone());
                }
            }
        }
        assert_eq!(scored_end, n, "every target scored");
        assert_eq!(out.per_chunk, emitted);
        assert_eq!(out.acc.nll_sum().to_bits(), nll.to_bits(), "the result is the emitted scores, bit for bit");
        assert_eq!((out.acc.tokens(), out.acc.bytes()), (toks, bytes));
        assert_eq!((toks, bytes), (n as u64, tables().count_bytes(&tokens[..n], &tokens[1..])));
        if cfg == aligned() {
            let want: Vec<Range<usize>> = (0..n_chunks).map(|c| 16 * c..(16 * (c + 1)).min(n)).collect();
            assert_eq!(scored_ranges(&events), want);
        }
    }
}

/// (a), (e): chunk 0 is scored with the untouched weights — bit for bit the score of a run
/// that never trains (lr 0) and equal to the sliding evaluation of its targets — while every
/// later chunk's score, and the weights, differ (the adaptation is real, so the other tests
/// cannot pass vacuously). With lr 0 the whole run is the sliding evaluation.
#[test]
fn ttt_first_chunk_is_the_untrained_score_and_later_ones_adapt() {
    let cfg = aligned();
    let n = 86;
    let tokens = random_tokens(n + 1, 5);
    let (out, _, trained_model) = run(&tokens, &cfg);
    let (frozen, _, frozen_model) = run(&tokens, &TttConfig { lr: 0.0, ..cfg.clone() });
    assert_eq!(out.per_chunk[0].0.to_bits(), frozen.per_chunk[0].0.to_bits());
    assert_eq!(out.per_chunk[0].1, frozen.per_chunk[0].1);
    for c in 1..out.chunks {
        let (a, b) = (out.per_chunk[c].0, frozen.per_chunk[c].0);
        assert!((a - b).abs() > 1e-4, "chunk {c}: TTT {a} vs no TTT {b}: training changed nothing");
    }
    let fresh = params(&model());
    assert_eq!(params(&frozen_model), fresh, "lr 0 leaves the weights alone");
    assert_ne!(params(&trained_model), fresh);

    let sc = cfg.sliding;
    let losses = sliding_losses(&frozen_model, &tokens, &sc);
    let chunk0: f64 = losses[..16].iter().map(|&l| f64::from(l)).sum();
    assert!(close(out.per_chunk[0].0, chunk0, 1e-12), "{} vs {chunk0}", out.per_chunk[0].0);
    let sliding = sliding_eval(&mut CandleModel::new(&frozen_model), &tokens, tables(), &sc, || true).unwrap().unwrap();
    assert!(close(frozen.acc.nll_sum(), sliding.nll_sum(), 1e-12));
    assert_eq!((frozen.acc.tokens(), frozen.acc.bytes()), (sliding.tokens(), sliding.bytes()));
}

/// (b): changing the tokens after the last target chunk `c` scores leaves the scores of
/// chunks `0..=c` bit for bit unchanged (no chunk's score depends on later tokens), and the
/// weights after training on chunk `c` too (so the weights that score chunk `c + 1` were
/// trained on nothing past chunk `c`), while the later chunks' scores do change.
#[test]
fn ttt_scores_do_not_depend_on_later_tokens() {
    for (cfg, n) in [(aligned(), 86usize), (misaligned(), 61)] {
        let tokens = random_tokens(n + 1, 6);
        let (base, events, snaps, _) = run_with_snapshots(&tokens, &cfg);
        let ranges = scored_ranges(&events);
        for c in [0, 1, base.chunks - 2] {
            // Target index `end − 1` is token `end`: change every token after it.
            let end = ranges[c].end;
            let mut changed = tokens.clone();
            let mut rng = fastrand::Rng::with_seed(c as u64);
            for t in &mut changed[end + 1..] {
                *t = (*t + rng.u32(1..VOCAB as u32)) % VOCAB as u32;
            }
            let (other, other_events, other_snaps, _) = run_with_snapshots(&changed, &cfg);
            assert_eq!(scored_ranges(&other_events), ranges);
            for k in 0..=c {
                assert_eq!(
                    base.per_chunk[k].0.to_bits(),
                    other.per_chunk[k].0.to_bits(),
                    "chunk {k} moved when tokens after chunk {c} changed"
                );
            }
            for k in c + 1..base.chunks {
                assert_ne!(base.per_chunk[k].0, other.per_chunk[k].0, "chunk {k} should see the change");
            }
            // The weights after training on chunk `c` (events S0 T0 … Sc Tc), which score
            // chunk `c + 1`, do not depend on the later tokens either.
            assert!(snaps[..=2 * c + 1] == other_snaps[..=2 * c + 1], "weights up to the training of chunk {c} saw later tokens");
            if c + 2 < base.chunks {
                assert!(snaps.last() != other_snaps.last(), "training on the changed chunk {} moves the weights", c + 1);
            }
        }
    }
}

/// Each chunk is scored with exactly the weights left by the training of the previous chunk
/// (the initial weights for chunk 0): the weights do not move between `Trained { c − 1 }`
/// and `Scored { c }`, and the reported score is the one those weights give (recomputed
/// target by target on a copy), not the one of the weights after training on the chunk
/// itself. With (b) this is score-before-update without trusting the trace's order.
#[test]
fn ttt_scores_each_chunk_with_the_weights_before_its_training() {
    for (cfg, n) in [(aligned(), 86usize), (misaligned(), 61)] {
        let tokens = random_tokens(n + 1, 10);
        let (out, events, snaps, _) = run_with_snapshots(&tokens, &cfg);
        let score = |snap: &[Vec<f64>], targets: &Range<usize>| -> f64 {
            let m = model_from(snap);
            targets.clone().map(|j| direct_nll(&m, &tokens, j, &cfg.sliding).0).sum()
        };
        for (i, e) in events.iter().enumerate() {
            let TttEvent::Scored { chunk, targets, nll_sum, .. } = e else {
                continue;
            };
            let before = if i == 0 { params(&model()) } else { snaps[i - 1].clone() };
            assert!(snaps[i] == before, "chunk {chunk}: the weights moved between the previous training and the scoring");
            let want = score(&before, targets);
            assert!(close(*nll_sum, want, 1e-6), "chunk {chunk}: reported {nll_sum}, its weights give {want}");
            assert_eq!(out.per_chunk[*chunk].0, *nll_sum);
            if let Some(after) = snaps.get(i + 1) {
                let adapted = score(after, targets);
                assert!((adapted - want).abs() > 1e-3, "chunk {chunk}: training on it must change its score ({adapted} vs {want})");
            }
        }
    }
}

/// An independent replay of §4.7 written with plain loops: score chunk `c` target by target
/// (each in its own window, unpadded) with weights trained only on chunks `< c`, then train
/// on chunk `c` (mean CE, backward, clip, SGD). Every chunk's TTT score matches the replay,
/// and not the illegal order (train on the chunk, then score it), which differs by far more
/// than the tolerance; the final weights match (the last chunk is never trained on).
#[test]
fn ttt_matches_an_independent_score_then_train_replay() {
    let cfg = aligned();
    let (n, chunk, t) = (86usize, cfg.chunk_tokens, cfg.sliding.seq_len);
    let tokens = random_tokens(n + 1, 7);
    let (out, _, ttt_model) = run(&tokens, &cfg);
    let n_chunks = out.chunks;

    let m = model();
    let all: Vec<(String, Var)> = m.params().iter().map(|(name, v, _)| (name.clone(), v.clone())).collect();
    let mut sgd = Sgd::new(all, cfg.momentum).unwrap();
    let chunk_score =
        |m: &Gpt, c: usize| -> f64 { (c * chunk..((c + 1) * chunk).min(n)).map(|j| direct_nll(m, &tokens, j, &cfg.sliding).0).sum() };
    for c in 0..n_chunks {
        let legal = chunk_score(&m, c);
        let got = out.per_chunk[c].0;
        assert!(close(got, legal, 1e-6), "chunk {c}: TTT {got}, score-first replay {legal}");
        if c + 1 == n_chunks {
            break;
        }
        let lr = cfg.lr * 0.5 * (1.0 + (std::f64::consts::PI * c as f64 / (n_chunks - 1) as f64).cos());
        for _ in 0..cfg.epochs {
            for s in 0..chunk / t {
                let base = c * chunk + s * t;
                let x = Tensor::from_slice(&tokens[base..base + t], (1, t), &Device::Cpu).unwrap();
                let y = Tensor::from_slice(&tokens[base + 1..base + t + 1], (1, t), &Device::Cpu).unwrap();
                let mut store = m.loss(&x, &y).unwrap().backward().unwrap();
                let mut grads = GradStore::default();
                let mut sq = 0.0;
                for (_, v, _) in m.params() {
                    let g = store.remove(v.as_tensor()).unwrap();
                    sq += g.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
                    grads.insert(v.as_tensor(), g);
                }
                let coef = (cfg.grad_clip / (sq.sqrt() + 1e-6)).min(1.0);
                let scaled: HashMap<String, Tensor> =
                    m.params().iter().map(|(name, v, _)| (name.clone(), (grads.get(v.as_tensor()).unwrap() * coef).unwrap())).collect();
                for (name, v, _) in m.params() {
                    grads.insert(v.as_tensor(), scaled[name].clone());
                }
                sgd.step(&grads, lr).unwrap();
            }
        }
        let illegal = chunk_score(&m, c);
        assert!((illegal - legal).abs() > 1e-3, "chunk {c}: scoring after training ({illegal}) must be distinguishable from {legal}");
        assert!(!close(got, illegal, 1e-6));
    }
    for ((name, _, _), (a, b)) in m.params().iter().zip(params(&m).iter().zip(params(&ttt_model).iter())) {
        let err = crate::model::compare::worst(a.iter().zip(b).map(|(x, y)| (x - y).abs()));
        assert!(err < 1e-9, "{name}: replay and TTT weights differ by {err}");
    }
}

/// On a stream that repeats a short phrase, test-time training lowers the loss of later
/// chunks (the update goes downhill), and the chunk-0 score is unaffected.
#[test]
fn ttt_learns_a_repeated_phrase() {
    let phrase = random_tokens(5, 8);
    let tokens: Vec<u32> = (0..161).map(|i| phrase[i % 5]).collect();
    let cfg = TttConfig { lr: 0.5, epochs: 3, batch_seqs: 2, ..aligned() };
    let (out, _, _) = run(&tokens, &cfg);
    let (frozen, _, _) = run(&tokens, &TttConfig { lr: 0.0, ..cfg.clone() });
    assert_eq!(out.per_chunk[0].0.to_bits(), frozen.per_chunk[0].0.to_bits());
    let later = |o: &TttOutcome| o.per_chunk[1..].iter().map(|p| p.0).sum::<f64>();
    assert!(later(&out) < 0.5 * later(&frozen), "TTT {} vs frozen {}", later(&out), later(&frozen));
    assert!(out.acc.val_bpb() < frozen.acc.val_bpb());
}

#[test]
fn ttt_stops_when_asked_and_checks_its_config() {
    let tokens = random_tokens(87, 9);
    // Scoring batches and training batches both ask: stop at every possible point.
    for stop_at in [1, 2, 3, 4, 8, 12] {
        let calls = Cell::new(0);
        let keep_going = || {
            calls.set(calls.get() + 1);
            calls.get() < stop_at
        };
        let r = score_first_ttt(&mut CandleModel::new(model()), &tokens, tables(), &aligned(), |_| {}, keep_going).unwrap();
        assert!(r.is_none(), "stop at call {stop_at}");
        assert_eq!(calls.get(), stop_at);
    }
    let e =
        score_first_ttt(&mut CandleModel::new(model()), &tokens, tables(), &TttConfig { chunk_tokens: 4, ..aligned() }, |_| {}, || true)
            .unwrap_err();
    assert!(e.to_string().contains("`chunk_tokens`"), "{e}");
    // A stream shorter than one chunk: one chunk, scored, never trained on.
    let mut events = Vec::new();
    let out = score_first_ttt(&mut CandleModel::new(model()), &tokens[..11], tables(), &aligned(), |e| events.push(e.clone()), || true)
        .unwrap()
        .unwrap();
    assert_eq!((out.chunks, out.acc.tokens(), events.len()), (1, 10, 1));
}

/// The memory estimate's rows: a step trains on at most a chunk's whole sequences, shared
/// between the ranks, never more than `batch_seqs` (the record's 32 over chunks of 16).
#[test]
fn a_ranks_rows_are_bounded_by_the_chunk_and_shared() {
    let cfg = |chunk_tokens, batch_seqs| TttConfig {
        sliding: SlidingConfig { seq_len: 2048, stride: 64, batch_windows: 32 },
        chunk_tokens,
        batch_seqs,
        ..TttConfig::default()
    };
    assert_eq!(cfg(32768, 32).rows_per_rank(1), (16, "chunk_tokens"));
    assert_eq!(cfg(32768, 32).rows_per_rank(8), (2, "chunk_tokens"));
    assert_eq!(cfg(32768, 4).rows_per_rank(1), (4, "batch_seqs"));
    assert_eq!(cfg(32768, 4).rows_per_rank(3), (2, "batch_seqs"));
    assert_eq!(cfg(131072, 32).rows_per_rank(1), (32, "batch_seqs"));
    assert_eq!(cfg(1024, 32).rows_per_rank(1), (1, "chunk_tokens"), "a chunk shorter than a sequence trains one");
}

/// With a byte sidecar in the tables (CaseOps data) every path charges target `i` the sidecar's
/// entry `i + 1`: sliding over the whole stream, score-first TTT chunk by chunk, phased TTT in
/// all; a sidecar shorter than the stream is refused, not indexed past.
#[test]
fn a_sidecar_charges_each_target_its_stream_position() {
    let m = model();
    let tokens = random_tokens(84, 9);
    let n = tokens.len() - 1;
    let side: Vec<u16> = (0..tokens.len()).map(|k| (k * 7 % 11) as u16 + u16::from(k == 0) * 50).collect();
    let between = |r: Range<usize>| side[r.start + 1..r.end + 1].iter().map(|&b| u64::from(b)).sum::<u64>();
    let with_side = Arc::new((*tables()).clone().with_stream_bytes(side.clone()));
    let sc = SlidingConfig { seq_len: 16, stride: 4, batch_windows: 5 };
    let acc = sliding_eval(&mut CandleModel::new(&m), &tokens, with_side.clone(), &sc, || true).unwrap().unwrap();
    assert_eq!((acc.tokens(), acc.bytes()), (n as u64, between(0..n)));
    assert_ne!(acc.bytes(), tables().count_bytes(&tokens[..n], &tokens[1..]));
    let plain = sliding_eval(&mut CandleModel::new(&m), &tokens, tables(), &sc, || true).unwrap().unwrap();
    assert_eq!(plain.nll_sum().to_bits(), acc.nll_sum().to_bits(), "the losses do not depend on the bytes");

    let mut chunks = Vec::new();
    let out = score_first_ttt(
        &mut CandleModel::new(model()),
        &tokens,
        with_side.clone(),
        &misaligned(),
        |e| {
            if let TttEvent::Scored { targets, bytes, .. } = e {
                chunks.push((targets.clone(), *bytes));
            }
        },
        || true,
    )
    .unwrap()
    .unwrap();
    assert!(chunks.len() > 2);
    for (targets, bytes) in &chunks {
        assert_eq!(*bytes, between(targets.clone()), "chunk of targets {targets:?}");
    }
    assert_eq!(out.acc.bytes(), between(0..n));

    let phased = crate::eval::phased::phased_ttt(
        &mut CandleModel::new(model()),
        &tokens,
        with_side.clone(),
        (
            &crate::eval::phased::PhasedConfig {
                lora_rank: 2,
                chunk: 8,
                context: 16,
                batch_docs: 2,
                prefix_docs: 2,
                phases: 1,
                global_chunk_tokens: 32,
                global_seq_len: 16,
                global_batch_seqs: 2,
                ..Default::default()
            },
            1,
            3,
        ),
        &Single,
        |_| {},
        || true,
    )
    .unwrap()
    .unwrap();
    assert_eq!((phased.acc.tokens(), phased.acc.bytes()), (n as u64, between(0..n)));

    let short = Arc::new((*tables()).clone().with_stream_bytes(side[..n].to_vec()));
    let e = sliding_eval(&mut CandleModel::new(&m), &tokens, short.clone(), &sc, || true).unwrap_err();
    assert!(e.to_string().contains("byte sidecar covers 83 tokens of a validation stream of 84"), "{e}");
    assert!(score_first_ttt(&mut CandleModel::new(model()), &tokens, short.clone(), &misaligned(), |_| {}, || true).is_err());
}

//! Launches of the fused ops' GPU kernels (`kernels/fused.cu`, compiled to PTX by build.rs;
//! `cuda` builds only; the device maths they share with the engine's kernels is in the
//! headers of `kernels/ops/`). Most kernels work on rows ([`rows_op`]): one warp per row of `len`
//! elements, eight rows per block, the inputs and the output contiguous, of one dtype (`f32`
//! or `bf16`) and one shape, plus small extra inputs such as a table; the embedding gradient has
//! its own launch. The CPU references they are checked against are the CPU implementations of
//! the ops that call them (each op's file in [`crate::model::ops`]); `pipeline parity` compares
//! the two on a GPU.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Result, bail};

/// The PTX of kernels/fused.cu.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
/// The name the module is cached under in candle's device.
const MODULE: &str = "pipeline-fused";
/// Threads per block of the row kernels (8 warps: 8 rows of the warp-per-row kernels).
const BLOCK: usize = 256;

/// Runs kernel `{name}_{f32|bf16}(inputs..., out, rows, len, param)` over the rows of `len`
/// elements of `inputs` (all of the first input's shape) and returns the output's storage.
pub fn rows_op(name: &str, inputs: &[(&CudaStorage, &Layout)], len: usize, param: f32) -> Result<CudaStorage> {
    rows_op_with(name, inputs, &[], len, param, &[])
}

/// [`rows_op`] with `extras` (contiguous, of any shape, e.g. a table) passed after the inputs
/// and `ints` after `param`: `{name}_{f32|bf16}(inputs..., extras..., out, rows, len, param,
/// ints...)`.
pub fn rows_op_with(
    name: &str,
    inputs: &[(&CudaStorage, &Layout)],
    extras: &[(&CudaStorage, &Layout)],
    len: usize,
    param: f32,
    ints: &[i32],
) -> Result<CudaStorage> {
    rows_op_mixed(name, inputs, extras, one_dtype(name, inputs, extras)?, len, param, ints)
}

/// [`rows_op_with`] for a kernel that also has a 16-byte-chunk form `{chunked}_{f32|bf16}` of
/// the same signature (one 16-byte load per lane, several rows per warp): that form runs when
/// the rows are whole chunks (`chunk_lanes`) and every argument is 16-byte aligned.
pub fn rows_op_chunked(
    name: &str,
    chunked: &str,
    inputs: &[(&CudaStorage, &Layout)],
    extras: &[(&CudaStorage, &Layout)],
    len: usize,
    param: f32,
    ints: &[i32],
) -> Result<CudaStorage> {
    let dtype = one_dtype(name, inputs, extras)?;
    let all: Vec<_> = inputs.iter().chain(extras).copied().collect();
    match chunk_lanes(dtype, len) {
        Some(lanes) if aligned16(&all)? => rows_op_lanes(chunked, inputs, extras, dtype, len, param, ints, lanes),
        _ => rows_op_mixed(name, inputs, extras, dtype, len, param, ints),
    }
}

/// The one dtype of every input and extra (an error naming both when they differ).
fn one_dtype(name: &str, inputs: &[(&CudaStorage, &Layout)], extras: &[(&CudaStorage, &Layout)]) -> Result<DType> {
    let Some(&(first, _)) = inputs.first() else { bail!("{name}: no inputs") };
    if let Some((s, _)) = inputs.iter().chain(extras).find(|(s, _)| s.dtype() != first.dtype()) {
        bail!("{name}: inputs of dtypes {:?} and {:?}", first.dtype(), s.dtype());
    }
    Ok(first.dtype())
}

/// [`rows_op_with`] for inputs and an output (of dtype `out`) of two dtypes, f32 and bf16: the
/// mixed-precision kernels `{name}_f32_bf16` (their signatures say which argument is which;
/// the ops calling them check). With one dtype throughout, the kernel `{name}_{f32|bf16}`.
pub fn rows_op_mixed(
    name: &str,
    inputs: &[(&CudaStorage, &Layout)],
    extras: &[(&CudaStorage, &Layout)],
    out: DType,
    len: usize,
    param: f32,
    ints: &[i32],
) -> Result<CudaStorage> {
    rows_op_lanes(name, inputs, extras, out, len, param, ints, 32)
}

/// The 16-byte-chunk form of a row kernel, when `len` values of `dtype` fit it: each row is
/// `len / E` chunks of `E = 16 / size` values, a power of two up to 32 and even (a half row is
/// whole chunks). Returns the threads per row, `None` when the warp-per-row kernel must run.
fn chunk_lanes(dtype: DType, len: usize) -> Option<usize> {
    let e = 16 / dtype.size_in_bytes();
    let lanes = len / e;
    (len.is_multiple_of(2 * e) && lanes.is_power_of_two() && (2..=32).contains(&lanes)).then_some(lanes)
}

/// Whether the first element of every input and extra is 16-byte aligned on the device (a
/// view into a tensor may start anywhere).
fn aligned16(inputs: &[(&CudaStorage, &Layout)]) -> Result<bool> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    for (s, l) in inputs {
        let stream = s.device().cuda_stream();
        let ptr = match AnyView::new("aligned16", s, l)? {
            AnyView::F32(v) => v.device_ptr(&stream).0,
            AnyView::Bf16(v) => v.device_ptr(&stream).0,
            AnyView::U32(v) => v.device_ptr(&stream).0,
        };
        if ptr % 16 != 0 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// [`rows_op_mixed`] with `lanes` threads per row (a power of two from 2 to 32; 32: a warp
/// per row) and blocks of 256 threads.
#[allow(clippy::too_many_arguments)]
fn rows_op_lanes(
    name: &str,
    inputs: &[(&CudaStorage, &Layout)],
    extras: &[(&CudaStorage, &Layout)],
    out: DType,
    len: usize,
    param: f32,
    ints: &[i32],
    lanes: usize,
) -> Result<CudaStorage> {
    if !lanes.is_power_of_two() || !(2..=32).contains(&lanes) {
        bail!("{name}: {lanes} threads per row (2 to 32, a power of two)");
    }
    let Some(&(_, layout)) = inputs.first() else { bail!("{name}: no inputs") };
    if let Some((_, l)) = inputs.iter().chain(extras).find(|(_, l)| !l.is_contiguous()) {
        bail!("{name}: every input must be contiguous, got {l:?}");
    }
    if let Some((_, l)) = inputs.iter().find(|(_, l)| l.dims() != layout.dims()) {
        bail!("{name}: inputs of shapes {:?} and {:?}", layout.shape(), l.shape());
    }
    let dtypes: Vec<DType> = inputs.iter().chain(extras).map(|(s, _)| s.dtype()).chain([out]).collect();
    let kernel = format!("{name}_{}", type_suffix(name, &dtypes)?);
    let args = inputs.iter().chain(extras).map(|(s, l)| AnyView::new(name, s, l)).collect::<Result<Vec<_>>>()?;
    let n = layout.shape().elem_count();
    if len == 0 || !n.is_multiple_of(len) {
        bail!("{name}: {n} elements do not split into rows of {len}");
    }
    let rows = Rows { n, rows: n / len, len, lanes };
    match out {
        DType::F32 => launch_rows::<f32>(&kernel, inputs[0].0, &args, rows, param, ints),
        DType::BF16 => launch_rows::<half::bf16>(&kernel, inputs[0].0, &args, rows, param, ints),
        dt => bail!("{name}: the GPU kernel writes f32 or bf16, not {dt:?}"),
    }
}

/// `softcap_ce_fwd_{f32|bf16}(logits, targets, loss, rows, v, cap)`: the `(rows,)` f32 losses
/// of `(rows, v)` logits (contiguous) and u32 targets; a warp per row.
pub fn softcap_ce_fwd(logits: (&CudaStorage, &Layout), targets: (&CudaStorage, &Layout), cap: f32) -> Result<CudaStorage> {
    let (rows, v) = logits.1.shape().dims2()?;
    softcap_ce_check(logits, targets, rows)?;
    let kernel = format!("softcap_ce_fwd_{}", type_suffix("softcap_ce", &[logits.0.dtype()])?);
    let args = [AnyView::new("softcap_ce", logits.0, logits.1)?, AnyView::new("softcap_ce", targets.0, targets.1)?];
    launch_rows::<f32>(&kernel, logits.0, &args, Rows::warp(rows, rows, v), cap, &[])
}

/// `softcap_ce_bwd_{f32|bf16}(logits, targets, lg, dlogits, rows, v, cap)`: the gradient of the
/// logits, in their dtype, from `lg` `(2, rows)` f32 = the forward losses and their gradients.
pub fn softcap_ce_bwd(
    logits: (&CudaStorage, &Layout),
    targets: (&CudaStorage, &Layout),
    lg: (&CudaStorage, &Layout),
    cap: f32,
) -> Result<CudaStorage> {
    let (rows, v) = logits.1.shape().dims2()?;
    softcap_ce_check(logits, targets, rows)?;
    if lg.1.dims() != [2, rows] || !lg.1.is_contiguous() || lg.0.dtype() != DType::F32 {
        bail!("softcap_ce: losses and gradients must be (2, {rows}) contiguous f32, got {:?} {:?}", lg.1, lg.0.dtype());
    }
    let kernel = format!("softcap_ce_bwd_{}", type_suffix("softcap_ce", &[logits.0.dtype()])?);
    let args = [
        AnyView::new("softcap_ce", logits.0, logits.1)?,
        AnyView::new("softcap_ce", targets.0, targets.1)?,
        AnyView::new("softcap_ce", lg.0, lg.1)?,
    ];
    match logits.0.dtype() {
        DType::F32 => launch_rows::<f32>(&kernel, logits.0, &args, Rows::warp(rows * v, rows, v), cap, &[]),
        _ => launch_rows::<half::bf16>(&kernel, logits.0, &args, Rows::warp(rows * v, rows, v), cap, &[]),
    }
}

fn softcap_ce_check(logits: (&CudaStorage, &Layout), targets: (&CudaStorage, &Layout), rows: usize) -> Result<()> {
    if !logits.1.is_contiguous() || !targets.1.is_contiguous() || targets.1.dims() != [rows] || targets.0.dtype() != DType::U32 {
        bail!(
            "softcap_ce: logits {:?} and u32 targets {:?} ({:?}) must be contiguous (N, V) and (N,)",
            logits.1,
            targets.1,
            targets.0.dtype()
        );
    }
    Ok(())
}

/// The kernel-name suffix of a set of argument dtypes: `f32`, `bf16`, or `f32_bf16` for both.
fn type_suffix(name: &str, dtypes: &[DType]) -> Result<&'static str> {
    let has = |d: DType| dtypes.contains(&d);
    if let Some(other) = dtypes.iter().find(|d| !matches!(d, DType::F32 | DType::BF16)) {
        bail!("{name}: the GPU kernel supports f32 and bf16, got {other:?}");
    }
    Ok(match (has(DType::F32), has(DType::BF16)) {
        (true, true) => "f32_bf16",
        (false, true) => "bf16",
        _ => "f32",
    })
}

/// The elements of `l` (a contiguous layout: callers check) in `s`, as a device view of `T`.
pub(crate) fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    let start = l.start_offset();
    Ok(s.as_cuda_slice::<T>()?.slice(start..start + l.shape().elem_count()))
}

/// A kernel argument: the device view of an input of either float dtype, or of token ids.
enum AnyView<'a> {
    F32(candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>),
    Bf16(candle_core::cuda_backend::cudarc::driver::CudaView<'a, half::bf16>),
    U32(candle_core::cuda_backend::cudarc::driver::CudaView<'a, u32>),
}

impl<'a> AnyView<'a> {
    fn new(name: &str, s: &'a CudaStorage, l: &Layout) -> Result<Self> {
        match s.dtype() {
            DType::F32 => Ok(Self::F32(view(s, l)?)),
            DType::BF16 => Ok(Self::Bf16(view(s, l)?)),
            DType::U32 => Ok(Self::U32(view(s, l)?)),
            dt => bail!("{name}: the GPU kernel takes f32, bf16 and u32 (token ids) arguments, got {dt:?}"),
        }
    }

    /// Passes the view as the launch's next argument.
    fn pass<'b>(&'b self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'b>) {
        match self {
            AnyView::F32(v) => b.arg(v),
            AnyView::Bf16(v) => b.arg(v),
            AnyView::U32(v) => b.arg(v),
        };
    }
}

/// The geometry of a row kernel's launch.
#[derive(Clone, Copy)]
struct Rows {
    /// Output elements.
    n: usize,
    /// Rows.
    rows: usize,
    /// Input elements per row.
    len: usize,
    /// Threads per row (32: a warp).
    lanes: usize,
}

impl Rows {
    fn warp(n: usize, rows: usize, len: usize) -> Self {
        Self { n, rows, len, lanes: 32 }
    }
}

/// Launches `kernel(args..., out, rows, len, param, ints...)` with `lanes` threads per row (of
/// `len` input elements) in blocks of 256 threads, writing the `n` output elements (of type
/// `O`).
fn launch_rows<O: CudaDType + DeviceRepr>(
    kernel: &str,
    on: &CudaStorage,
    args: &[AnyView<'_>],
    Rows { n, rows, len, lanes }: Rows,
    param: f32,
    ints: &[i32],
) -> Result<CudaStorage> {
    let dev = on.device().clone();
    // SAFETY: every element is written by the kernel (each row's warp writes all of its row's
    // outputs).
    let out = unsafe { dev.alloc::<O>(n)? };
    if rows > 0 {
        let func = dev.get_or_load_custom_func(kernel, MODULE, PTX)?;
        let (rows_arg, len_arg) =
            (rows as i64, i32::try_from(len).map_err(|_| candle_core::Error::Msg(format!("{kernel}: row of {len}")))?);
        let per_block = BLOCK / lanes;
        let blocks = u32::try_from(rows.div_ceil(per_block)).map_err(|_| candle_core::Error::Msg(format!("{kernel}: {rows} rows")))?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK as u32, 1, 1), shared_mem_bytes: 0 };
        let mut b = func.builder();
        for v in args {
            v.pass(&mut b);
        }
        b.arg(&out);
        b.arg(&rows_arg);
        b.arg(&len_arg);
        b.arg(&param);
        for i in ints {
            b.arg(i);
        }
        // SAFETY: the kernel's signature is (const A*..., O*, long, int, float, int...), as passed
        // (the argument and output types select the kernel's name).
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `embedding_bwd_{f32|bf16}(ids, g, dw, n, c)`: the `(vocab, c)` gradient of an embedding
/// table from the `(n, c)` gradient `g` of the looked-up rows of token ids `ids` (u32).
pub fn embedding_bwd(ids: (&CudaStorage, &Layout), g: (&CudaStorage, &Layout), vocab: usize) -> Result<CudaStorage> {
    let (n, c) = g.1.shape().dims2()?;
    if ids.1.shape().elem_count() != n || !ids.1.is_contiguous() || !g.1.is_contiguous() {
        bail!("embedding_bwd: ids {:?} and gradient {:?} must be contiguous (n,) and (n, c)", ids.1, g.1);
    }
    match g.0.dtype() {
        DType::F32 => embedding_bwd_t::<f32>("f32", ids, g, vocab, n, c),
        DType::BF16 => embedding_bwd_t::<half::bf16>("bf16", ids, g, vocab, n, c),
        dt => bail!("embedding_bwd: the GPU kernel supports f32 and bf16, got {dt:?}"),
    }
}

fn embedding_bwd_t<T: CudaDType + DeviceRepr>(
    suffix: &str,
    ids: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    vocab: usize,
    n: usize,
    c: usize,
) -> Result<CudaStorage> {
    let dev = g.0.device().clone();
    let ids_view = view::<u32>(ids.0, ids.1)?;
    let g_view = view::<T>(g.0, g.1)?;
    // SAFETY: the kernel writes every element (rows of unused ids get zeros).
    let out = unsafe { dev.alloc::<T>(vocab * c)? };
    if vocab > 0 && c > 0 {
        let func = dev.get_or_load_custom_func(&format!("embedding_bwd_{suffix}"), MODULE, PTX)?;
        let threads = 256u32;
        let cfg =
            LaunchConfig { grid_dim: (vocab as u32, (c as u32).div_ceil(threads), 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let (n_arg, c_arg) = (n as i64, c as i32);
        let mut b = func.builder();
        b.arg(&ids_view);
        b.arg(&g_view);
        b.arg(&out);
        b.arg(&n_arg);
        b.arg(&c_arg);
        // SAFETY: the kernel's signature is (const unsigned*, const T*, T*, long, int).
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// Rows per partial sum of [`column_dot`].
const COLUMN_CHUNK: usize = 64;

/// `column_dot_{partial,sum}_*`: the per-channel sums over rows of `a * b` (both `(rows, c)`,
/// contiguous) as `(c,)` in `a`'s dtype, accumulated in f32 in a fixed order (partial sums of
/// 64 rows, then the partials in order). Both f32 or both bf16, or `a` f32 and `b` bf16 (the
/// gradient of a bf16 product's per-channel scale under mixed precision).
pub fn column_dot(a: (&CudaStorage, &Layout), b: (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    let (rows, c) = a.1.shape().dims2()?;
    if b.1.dims() != a.1.dims() || !a.1.is_contiguous() || !b.1.is_contiguous() {
        bail!("column_dot: inputs {:?} and {:?} must be contiguous, of one shape", a.1, b.1);
    }
    let partial = match (a.0.dtype(), b.0.dtype()) {
        (DType::F32, DType::F32) => "f32",
        (DType::BF16, DType::BF16) => "bf16",
        (DType::F32, DType::BF16) => "f32_bf16",
        (x, y) => bail!("column_dot: the GPU kernel takes f32 or bf16 pairs and (f32, bf16), got ({x:?}, {y:?})"),
    };
    let (av, bv) = (AnyView::new("column_dot", a.0, a.1)?, AnyView::new("column_dot", b.0, b.1)?);
    match a.0.dtype() {
        DType::F32 => column_dot_t::<f32>(partial, "f32", a.0, (&av, &bv), rows, c),
        _ => column_dot_t::<half::bf16>(partial, "bf16", a.0, (&av, &bv), rows, c),
    }
}

fn column_dot_t<T: CudaDType + DeviceRepr>(
    partial_suffix: &str,
    suffix: &str,
    on: &CudaStorage,
    (av, bv): (&AnyView<'_>, &AnyView<'_>),
    rows: usize,
    c: usize,
) -> Result<CudaStorage> {
    let dev = on.device().clone();
    let chunks = rows.div_ceil(COLUMN_CHUNK).max(1);
    // SAFETY: the first kernel writes every partial (a zero sum for an empty chunk), the
    // second every output.
    let partial = unsafe { dev.alloc::<f32>(chunks * c)? };
    let out = unsafe { dev.alloc::<T>(c)? };
    if c == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(out, dev));
    }
    let int = |x: usize| i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("column_dot: {x} too large")));
    let (c_arg, chunk_arg, chunks_arg, rows_arg) = (int(c)?, int(COLUMN_CHUNK)?, int(chunks)?, rows as i64);
    let threads = 128u32;
    let col_blocks = (c as u32).div_ceil(threads);
    let grid_y = u32::try_from(chunks).ok().filter(|&y| y <= 65_535);
    let Some(grid_y) = grid_y else { bail!("column_dot: {rows} rows exceed the grid") };
    let func = dev.get_or_load_custom_func(&format!("column_dot_partial_{partial_suffix}"), MODULE, PTX)?;
    let cfg = LaunchConfig { grid_dim: (col_blocks, grid_y, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let mut lb = func.builder();
    av.pass(&mut lb);
    bv.pass(&mut lb);
    lb.arg(&partial).arg(&rows_arg).arg(&c_arg).arg(&chunk_arg);
    // SAFETY: (const A* a, const B* b, float* partial, long rows, int c, int chunk), A and B as
    // named by the suffix.
    unsafe { lb.launch(cfg) }.w()?;
    let func = dev.get_or_load_custom_func(&format!("column_dot_sum_{suffix}"), MODULE, PTX)?;
    let cfg = LaunchConfig { grid_dim: (col_blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let mut lb = func.builder();
    lb.arg(&partial).arg(&out).arg(&chunks_arg).arg(&c_arg);
    // SAFETY: (const float* partial, T* out, int chunks, int c).
    unsafe { lb.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `cast_f32_to_bf16` / `cast_bf16_to_f32` of the contiguous `x` (its start 8 elements aligned):
/// eight values per thread and step, rounding to nearest even.
pub fn cast(x: &CudaStorage, l: &Layout, to: DType) -> Result<CudaStorage> {
    let n = l.shape().elem_count();
    if !l.is_contiguous() || !l.start_offset().is_multiple_of(8) {
        bail!("cast: the input must be contiguous from an 8-element boundary, got {l:?}");
    }
    let dev = x.device().clone();
    let threads = 256u32;
    let blocks = u32::try_from((n / 8).div_ceil(threads as usize).clamp(1, 65_535)).unwrap_or(65_535);
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let n_arg = n as i64;
    match (x.dtype(), to) {
        (DType::F32, DType::BF16) => {
            let xv = view::<f32>(x, l)?;
            // SAFETY: every element is written (groups of eight, then the tail).
            let out = unsafe { dev.alloc::<half::bf16>(n)? };
            if n > 0 {
                let func = dev.get_or_load_custom_func("cast_f32_to_bf16", MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&xv).arg(&out).arg(&n_arg);
                // SAFETY: (const float* x, bf16* y, long n).
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        (DType::BF16, DType::F32) => {
            let xv = view::<half::bf16>(x, l)?;
            // SAFETY: as above.
            let out = unsafe { dev.alloc::<f32>(n)? };
            if n > 0 {
                let func = dev.get_or_load_custom_func("cast_bf16_to_f32", MODULE, PTX)?;
                let mut b = func.builder();
                b.arg(&xv).arg(&out).arg(&n_arg);
                // SAFETY: (const bf16* x, float* y, long n).
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        (from, to) => bail!("cast: the GPU kernel casts between f32 and bf16, not {from:?} to {to:?}"),
    }
}

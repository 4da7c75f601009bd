//! The float arithmetic the CPU kernels share: the [`Real`] types (`f32`, `f64`) with a
//! branch-free `exp` and `tanh` for `f32`, the [`multiversion!`] dispatch that compiles a kernel
//! twice (baseline target and AVX2 + FMA, picked at run time: the folder's one `unsafe` block),
//! and the vectorisable inner loops: dot products, sums, maxima and a small register-tiled
//! matrix product ([`gemm_acc`]).
//!
//! Every helper is `#[inline(always)]`, so that it is compiled inside the multiversioned kernel
//! that calls it, with that kernel's vector width. The order of each sum is fixed by the code
//! (eight partial sums, then a fixed tree), never by the thread schedule.

use candle_core::WithDType;

/// The float types the kernels run on, with the maths functions they need. For `f32`, `exp`
/// and `tanh` are branch-free approximations (a few ulp) so that loops over them vectorise;
/// `f64` (used by the gradient checks) keeps the standard library's.
pub(crate) trait Real: WithDType {
    fn exp(self) -> Self;
    fn tanh(self) -> Self;
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn tanh(self) -> Self {
        tanh_f32(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// `e^x`: Cephes' `expf` polynomial after the reduction `x = n ln 2 + r`, `|r| <= ln 2 / 2`.
/// Inputs are clamped to `[-87.3, 88.3]` (so tiny results are about 1e-38 rather than 0 or
/// subnormal); NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.3);
    let shifted = x * std::f32::consts::LOG2_E + SHIFT;
    let n = shifted - SHIFT;
    // ln 2 split in two so that `x - n ln 2` is exact enough.
    let r = (x - n * 0.693_359_4) + n * 2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n from the exponent bits; n is in [-126, 127] after the clamp.
    let two_n = f32::from_bits(shifted.to_bits().wrapping_sub(SHIFT.to_bits()).wrapping_add(127) << 23);
    y * two_n
}

/// `tanh(x)`: the rational approximation of Eigen's `generic_fast_tanh_float` (degree 13 / 6,
/// inputs clamped to +-7.9, where tanh is 1 to f32 precision; `x` itself below 4e-4).
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let c = x.clamp(-7.905_311, 7.905_311);
    let c2 = c * c;
    let mut p = -2.760_768_5e-16f32;
    p = p * c2 + 2.000_188e-13;
    p = p * c2 - 8.604_672e-11;
    p = p * c2 + 5.122_297e-8;
    p = p * c2 + 1.485_722_4e-5;
    p = p * c2 + 6.372_619e-4;
    p = p * c2 + 4.893_524_6e-3;
    let mut q = 1.198_258_4e-6f32;
    q = q * c2 + 1.185_347_1e-4;
    q = q * c2 + 2.268_434_7e-3;
    q = q * c2 + 4.893_525e-3;
    if x.abs() < 4e-4 { x } else { c * p / q }
}

/// Generates `$name`, which runs `$kernel` compiled for AVX2 and FMA when the CPU has them
/// (runtime detection) and as compiled for the baseline target otherwise. The kernels and
/// everything they call are `#[inline(always)]`, so the whole loop nest is compiled with the
/// wider vectors.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident = $kernel:ident($($arg:ident: $ty:ty),* $(,)?);) => {
        $(#[$doc])*
        fn $name<T: $crate::model::host::simd::Real>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                fn wide<T: $crate::model::host::simd::Real>($($arg: $ty),*) {
                    $kernel::<T>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: `wide` has no requirement besides the CPU features detected just above.
                    return unsafe { wide::<T>($($arg),*) };
                }
            }
            $kernel::<T>($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// `sum(a * b)` in `T`, eight partial sums added in a fixed tree.
#[inline(always)]
pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    // Eight independent partial sums so that the loop vectorises.
    let zero = T::from_f64(0.0);
    let mut acc = [zero; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let mut tail = zero;
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `sum(a * b)` accumulated in f64.
#[inline(always)]
pub(crate) fn dot_f64<T: Real>(a: &[T], b: &[T]) -> f64 {
    let mut acc = [0.0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let mut tail = 0.0;
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x.to_f64() * y.to_f64();
    }
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x.to_f64() * y.to_f64();
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// `sum(a)` accumulated in f64.
#[inline(always)]
pub(crate) fn sum_f64<T: Real>(a: &[T]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = a.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|x| x.to_f64()).sum();
    for x in chunks {
        for (s, &x) in acc.iter_mut().zip(x) {
            *s += x.to_f64();
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// The largest element (`-inf` for an empty slice).
#[inline(always)]
pub(crate) fn max_of<T: Real>(a: &[T]) -> T {
    let mut acc = [T::from_f64(f64::NEG_INFINITY); 8];
    let chunks = a.chunks_exact(8);
    let mut m = acc[0];
    for &x in chunks.remainder() {
        m = if x > m { x } else { m };
    }
    for x in chunks {
        for (s, &x) in acc.iter_mut().zip(x) {
            *s = if x > *s { x } else { *s };
        }
    }
    acc.iter().fold(m, |m, &x| if x > m { x } else { m })
}

/// `C += A B` for an `(m, k)` matrix `A` given elementwise by `a(row, col)`, a row-major
/// `(k, n)` matrix `B` with row stride `ldb`, and a row-major `(m, n)` matrix `C` with row stride
/// `ldc`. Register tiles of 4 x 8; `A` is packed per 4-row panel first.
// Indexed loops with constant bounds: the iterator version of the tile update is not
// vectorised by LLVM (it spills the tile and runs scalar).
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(crate) fn gemm_acc<T: Real>(
    (m, n, k): (usize, usize, usize),
    a: impl Fn(usize, usize) -> T,
    b: &[T],
    ldb: usize,
    c: &mut [T],
    ldc: usize,
) {
    const MR: usize = 4;
    const NR: usize = 8;
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let zero = T::from_f64(0.0);
    let mut pack = vec![zero; k * MR];
    for i in (0..m).step_by(MR) {
        let mr = MR.min(m - i);
        for (p, panel) in pack.chunks_exact_mut(MR).enumerate() {
            for (r, x) in panel.iter_mut().enumerate() {
                *x = if r < mr { a(i + r, p) } else { zero };
            }
        }
        // Full tiles: the tile stays in registers only while every index into it is constant.
        let full = n - n % NR;
        for j in (0..full).step_by(NR) {
            let mut acc = [[zero; NR]; MR];
            for p in 0..k {
                let bp: &[T; NR] = b[p * ldb + j..p * ldb + j + NR].try_into().expect("NR elements");
                let ap: &[T; MR] = pack[p * MR..p * MR + MR].try_into().expect("MR elements");
                for r in 0..MR {
                    for l in 0..NR {
                        acc[r][l] += ap[r] * bp[l];
                    }
                }
            }
            for r in 0..MR {
                if r < mr {
                    let cr: &mut [T; NR] = (&mut c[(i + r) * ldc + j..(i + r) * ldc + j + NR]).try_into().expect("NR elements");
                    for l in 0..NR {
                        cr[l] += acc[r][l];
                    }
                }
            }
        }
        for r in 0..mr {
            for jj in full..n {
                let mut s = zero;
                for p in 0..k {
                    s += pack[p * MR + r] * b[p * ldb + jj];
                }
                c[(i + r) * ldc + jj] += s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_f32_exp_and_tanh_are_accurate() {
        let (mut exp_err, mut tanh_err) = (0.0f64, 0.0f64);
        let mut x = -90.0f64;
        while x < 90.0 {
            let xf = x as f32;
            let xd = xf as f64;
            if xd > -87.0 && xd < 88.0 {
                exp_err = exp_err.max((exp_f32(xf) as f64 - xd.exp()).abs() / xd.exp());
            }
            if xd != 0.0 {
                // Relative error, which also bounds the absolute one (|tanh| <= 1).
                tanh_err = tanh_err.max((tanh_f32(xf) as f64 - xd.tanh()).abs() / xd.tanh().abs());
            }
            x += if x.abs() < 1.0 { 1.3e-6 } else { 1.7e-4 };
        }
        assert!(exp_err < 2e-7, "exp: relative error {exp_err:e}");
        assert!(tanh_err < 1e-6, "tanh: relative error {tanh_err:e}");
        assert!(exp_f32(-200.0) < 2e-38 && exp_f32(-200.0) >= 0.0);
        assert_eq!(tanh_f32(1e-30), 1e-30);
        assert!(exp_f32(f32::NAN).is_nan() && tanh_f32(f32::NAN).is_nan());
    }
}

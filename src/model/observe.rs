//! Watching a forward pass's matrix products: an [`InputObserver`] receives the input `X`
//! `(N, in)` of every product `X W^T` with the state-dict names of the weights that read it, in
//! the order the pass takes them (each repeat of a looped block again). GPTQ's calibration
//! (`artifact::hessian`) sums `X^T X` per weight from it; nothing else in the model changes,
//! and a pass without an observer pays nothing.
//!
//! The inputs, per block `i` (physical index, also for looped repeats):
//!
//! ```text
//! blocks.i.attn.c_q/c_k/c_v.weight   norm(u) s            (one input, three weights)
//! blocks.i.attn.proj.weight          the attention output (after XSA)
//! blocks.i.mlp.fc.weight             norm(u) s            (the MLP's, the attention's in parallel blocks)
//! blocks.i.mlp.proj.weight           act(x Wfc^T)
//! tok_emb.weight | lm_head.weight    the final norm's output (the head's input)
//! ```

#[cfg(feature = "candle")]
use std::cell::RefCell;

use candle_core::{Result, Tensor};

/// Receives the inputs of a forward pass's products (see the module doc).
pub trait InputObserver {
    /// `x` `(N, in)` is the input of the products with the weights named `weights`.
    fn observe(&mut self, weights: &[String], x: &Tensor) -> Result<()>;

    /// Whether it wants the input of the products with the weights named `weights`: a pass
    /// that must copy an input out to hand it on (the engine's) skips those it does not want.
    fn wants(&self, _weights: &[String]) -> bool {
        true
    }
}

/// An observer as a forward pass holds it (borrowed for the pass, shared by its layers).
#[cfg(feature = "candle")]
pub(super) type Observer<'a> = &'a RefCell<&'a mut dyn InputObserver>;

/// Hands `x` to the observer, if any, with the names `names` makes (called only when there is
/// one, so a pass without an observer formats nothing).
#[cfg(feature = "candle")]
pub(super) fn observe(observer: Option<Observer<'_>>, x: &Tensor, names: impl FnOnce() -> Vec<String>) -> Result<()> {
    match observer {
        Some(o) => o.borrow_mut().observe(&names(), x),
        None => Ok(()),
    }
}

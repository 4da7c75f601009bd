//! A registry: the list of stage implementations a program offers, handed to the planner
//! ([`crate::runtime::graph::plan`]) and to `pipeline stages` ([`crate::runtime::catalog`]). The
//! runtime holds no list of its own; the GPT program's is `stages::REGISTRY`.

use crate::runtime::driver::StageFactory;

/// Stage implementations, in the order `pipeline stages` lists them. The first implementation
/// of a kind is the kind's default when a config leaves out `impl`.
#[derive(Clone, Copy)]
pub struct Registry(&'static [&'static dyn StageFactory]);

impl Registry {
    /// A registry of `list` (usable in a `static`).
    pub const fn new(list: &'static [&'static dyn StageFactory]) -> Self {
        Self(list)
    }

    /// Every implementation, in order.
    #[cfg(feature = "tools")]
    pub const fn all(&self) -> &'static [&'static dyn StageFactory] {
        self.0
    }

    /// Every stage kind, in registry order, without repeats.
    pub fn kinds(&self) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = Vec::new();
        for f in self.0 {
            if !out.contains(&f.kind()) {
                out.push(f.kind());
            }
        }
        out
    }

    /// The implementations of `kind`, in registry order (the first is the kind's default).
    pub fn impls(&self, kind: &str) -> Vec<&'static dyn StageFactory> {
        self.0.iter().copied().filter(|f| f.kind() == kind).collect()
    }

    /// The implementation `name` of `kind`.
    pub fn find(&self, kind: &str, name: &str) -> Option<&'static dyn StageFactory> {
        self.0.iter().copied().find(|f| f.kind() == kind && f.name() == name)
    }
}

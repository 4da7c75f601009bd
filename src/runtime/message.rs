//! Typed messages between stages.
//!
//! Every channel carries one Rust type. A stage implementation declares the type it takes and
//! the type it produces ([`MsgType`]); the graph builder compares them when it connects two
//! stages, so a mismatch is a config error before any thread starts, never a failed downcast at
//! run time.

use std::any::TypeId;
use std::sync::Arc;

/// A value that can travel on a channel. `Clone` is used only when one stage feeds several
/// (fan-out); large payloads should be cheap to clone (an `Arc` or a pooled handle).
pub trait Message: Clone + Send + 'static {
    /// The name shown in errors and in `pipeline stages`.
    const NAME: &'static str;
}

/// The identity of a message type, comparable at graph-build time.
#[derive(Clone, Copy, Debug)]
pub struct MsgType {
    /// Display name ([`Message::NAME`]).
    pub name: &'static str,
    id: fn() -> TypeId,
}

impl MsgType {
    /// The descriptor of `T`.
    pub fn of<T: Message>() -> Self {
        Self { name: T::NAME, id: TypeId::of::<T> }
    }

    /// The `TypeId` of the described type.
    pub fn type_id(&self) -> TypeId {
        (self.id)()
    }
}

impl PartialEq for MsgType {
    fn eq(&self, other: &Self) -> bool {
        self.type_id() == other.type_id()
    }
}

/// An opaque byte payload with a sequence number: what the generic test stages pass around.
#[derive(Clone, Debug)]
pub struct Blob {
    /// Position of the item in its source's output, from 0.
    pub seq: u64,
    /// The payload, shared between clones.
    pub data: Arc<[u8]>,
}

impl Message for Blob {
    const NAME: &'static str = "Blob";
}

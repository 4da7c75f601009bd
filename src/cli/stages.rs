//! `pipeline stages`: every stage kind, implementation and parameter of the registry.

use crate::stages::REGISTRY;

/// Prints the catalog, as text or JSON.
pub fn command(json: bool) -> i32 {
    if json {
        return super::print_json(&crate::runtime::catalog::catalog(&REGISTRY));
    }
    out_raw!("{}", crate::runtime::catalog::render(&REGISTRY));
    0
}

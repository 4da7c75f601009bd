//! `pipeline stages`: every stage kind, implementation and parameter of the registry.

use crate::stages::REGISTRY;

/// Prints the catalog, as text or JSON.
pub fn command(json: bool) -> i32 {
    if json {
        match serde_json::to_string_pretty(&crate::runtime::catalog::catalog(&REGISTRY)) {
            Ok(s) => out!("{s}"),
            Err(e) => {
                err!("error: {e}");
                return 1;
            }
        }
    } else {
        out_raw!("{}", crate::runtime::catalog::render(&REGISTRY));
    }
    0
}

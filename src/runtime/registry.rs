//! Lookup over `stages::REGISTRY`, the one list of stage implementations.

use crate::runtime::stage::StageFactory;
use crate::stages::REGISTRY;

/// Every stage kind, in registry order, without repeats.
pub fn kinds() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for f in REGISTRY {
        if !out.contains(&f.kind()) {
            out.push(f.kind());
        }
    }
    out
}

/// The implementations of `kind`, in registry order (the first is the kind's default).
pub fn impls(kind: &str) -> Vec<&'static dyn StageFactory> {
    REGISTRY.iter().copied().filter(|f| f.kind() == kind).collect()
}

/// The implementation `name` of `kind`.
pub fn find(kind: &str, name: &str) -> Option<&'static dyn StageFactory> {
    REGISTRY.iter().copied().find(|f| f.kind() == kind && f.name() == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::stage::Role;

    #[test]
    fn no_duplicate_kind_impl_pairs() {
        for (i, a) in REGISTRY.iter().enumerate() {
            for b in &REGISTRY[i + 1..] {
                assert!(!(a.kind() == b.kind() && a.name() == b.name()), "{}/{} registered twice", a.kind(), a.name());
            }
        }
    }

    #[test]
    fn names_are_snake_case_and_documented() {
        let ok = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        for f in REGISTRY {
            assert!(ok(f.kind()) && ok(f.name()), "{}/{}: names must be snake_case", f.kind(), f.name());
            assert!(!f.doc().is_empty(), "{}/{} has no doc line", f.kind(), f.name());
        }
    }

    #[test]
    fn one_role_per_kind_and_types_match_role() {
        for f in REGISTRY {
            for g in impls(f.kind()) {
                assert_eq!(f.role(), g.role(), "kind `{}` mixes roles", f.kind());
            }
            assert_eq!(f.input().is_none(), f.role() == Role::Source, "{}/{}", f.kind(), f.name());
            assert_eq!(f.output().is_none(), f.role() == Role::Sink, "{}/{}", f.kind(), f.name());
        }
    }

    #[test]
    fn every_param_is_documented() {
        for f in REGISTRY {
            let schema = f.schema();
            let props = schema.get("properties").and_then(|p| p.as_object()).cloned().unwrap_or_default();
            for (name, prop) in props {
                assert!(prop.get("description").is_some(), "{}/{}: parameter `{name}` has no doc comment", f.kind(), f.name());
            }
        }
    }

    #[test]
    fn defaults_resolve_when_no_param_is_required() {
        for f in REGISTRY {
            let schema = f.schema();
            let required = schema.get("required").and_then(|r| r.as_array()).map(|r| r.len()).unwrap_or(0);
            if required == 0 {
                let empty = figment::value::Value::from(figment::value::Dict::new());
                f.resolve(&empty).unwrap_or_else(|e| panic!("{}/{}: {e}", f.kind(), f.name()));
            }
        }
    }
}

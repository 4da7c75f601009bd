//! `pipeline stages`: every stage kind, its implementations and their parameters, read from the
//! registry and the parameters' JSON schemas (doc comments, types, defaults).

use serde::Serialize;

use crate::runtime::registry::Registry;

/// One parameter of an implementation.
#[derive(Debug, Clone, Serialize)]
pub struct ParamDoc {
    /// Key in the stage table.
    pub name: String,
    /// Type, as the schema gives it.
    #[serde(rename = "type")]
    pub ty: String,
    /// Default value (TOML/JSON spelling); `None` when the key is required.
    pub default: Option<String>,
    /// First line of its doc comment.
    pub doc: String,
}

/// One implementation.
#[derive(Debug, Clone, Serialize)]
pub struct ImplDoc {
    /// Stage kind.
    pub kind: String,
    /// Implementation name.
    #[serde(rename = "impl")]
    pub name: String,
    /// Source, transform or sink.
    pub role: String,
    /// Message type taken.
    pub input: Option<String>,
    /// Message type produced.
    pub output: Option<String>,
    /// One-line description.
    pub doc: String,
    /// Parameters.
    pub params: Vec<ParamDoc>,
}

fn type_of(prop: &serde_json::Value, schema: &serde_json::Value) -> String {
    if let Some(t) = prop.get("type") {
        return match t {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_str()).filter(|s| *s != "null").collect::<Vec<_>>().join("|"),
            other => other.to_string(),
        };
    }
    // A reference to an enum definition: list its values.
    let reference = prop.get("$ref").or_else(|| prop.get("allOf").and_then(|a| a.get(0)).and_then(|x| x.get("$ref")));
    if let Some(r) = reference.and_then(|r| r.as_str()) {
        let name = r.rsplit('/').next().unwrap_or(r);
        let def = schema.get("$defs").and_then(|d| d.get(name));
        let values: Vec<String> = def
            .and_then(|d| d.get("oneOf").or_else(|| d.get("enum")))
            .and_then(|v| v.as_array())
            .map(|arr| arr.iter().filter_map(|v| v.get("const").or(Some(v)).and_then(|c| c.as_str()).map(|s| format!("\"{s}\""))).collect())
            .unwrap_or_default();
        if !values.is_empty() {
            return values.join("|");
        }
        return name.to_string();
    }
    "value".into()
}

/// Describes every registered implementation.
pub fn catalog(registry: &Registry) -> Vec<ImplDoc> {
    let mut out = Vec::new();
    for kind in registry.kinds() {
        for f in registry.impls(kind) {
            let schema = serde_json::to_value(f.schema()).unwrap_or_default();
            let required: Vec<&str> = schema
                .get("required")
                .and_then(|r| r.as_array())
                .map(|r| r.iter().filter_map(|x| x.as_str()).collect())
                .unwrap_or_default();
            let mut params = Vec::new();
            if let Some(props) = schema.get("properties").and_then(|p| p.as_object()) {
                for (name, prop) in props {
                    let default = if required.contains(&name.as_str()) { None } else { prop.get("default").map(|d| d.to_string()) };
                    let doc = prop.get("description").and_then(|d| d.as_str()).unwrap_or("").lines().next().unwrap_or("").to_string();
                    params.push(ParamDoc { name: name.clone(), ty: type_of(prop, &schema), default, doc });
                }
            }
            out.push(ImplDoc {
                kind: kind.to_string(),
                name: f.name().to_string(),
                role: f.role().as_str().to_string(),
                input: f.input().map(|t| t.name.to_string()),
                output: f.output().map(|t| t.name.to_string()),
                doc: f.doc().to_string(),
                params,
            });
        }
    }
    out
}

/// The catalog as text.
pub fn render(registry: &Registry) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let mut last_kind = String::new();
    for d in catalog(registry) {
        if d.kind != last_kind {
            let _ = writeln!(o, "{}{} ({})", if last_kind.is_empty() { "" } else { "\n" }, d.kind, d.role);
            last_kind = d.kind.clone();
        }
        let io = format!("{} -> {}", d.input.as_deref().unwrap_or("()"), d.output.as_deref().unwrap_or("()"));
        let _ = writeln!(o, "  impl = \"{}\"   [{}]  {}", d.name, io, d.doc);
        // Columns as wide as this implementation's longest name, type and default.
        let defaults: Vec<String> = d.params.iter().map(|p| p.default.clone().unwrap_or_else(|| "(required)".into())).collect();
        let width = |min: usize, f: &dyn Fn(usize) -> usize| (0..d.params.len()).map(f).max().unwrap_or(0).max(min);
        let (wn, wt, wd) = (
            width(14, &|i| d.params[i].name.chars().count()),
            width(18, &|i| d.params[i].ty.chars().count()),
            width(10, &|i| defaults[i].chars().count()),
        );
        for (p, default) in d.params.iter().zip(&defaults) {
            let _ = writeln!(o, "      {:<wn$} {:<wt$} {:<wd$} {}", p.name, p.ty, default, p.doc);
        }
    }
    let _ = writeln!(
        o,
        "\nEvery stage table also takes: kind, impl (default: the kind's first), inputs = [\"stage\", ...] (not for sources), queue = N (capacity of the channel feeding the stage, default 2)."
    );
    o
}

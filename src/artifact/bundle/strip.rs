//! What a source file keeps in the bundle: the code the compiler reads, without what it skips.
//!
//! - **Rust** is parsed (syn) and printed back from its tokens: comments are gone with the
//!   parse, doc comments (`#[doc]` attributes) and items the build never compiles (`#[test]`,
//!   `#[cfg(test)]`, and any `cfg` that needs `test` or a feature the build lacks, or lacks
//!   one it has: `#[cfg(feature = "candle")]` in the lean record build) are removed,
//!   `#[cfg_attr(..)]`s that do not apply too,
//!   and the tokens are printed with a space only where two would otherwise lex as one, one
//!   top-level item per line: the same program to rustc, with no indentation.
//! - **C, C++ and CUDA** go through a lexer that knows string and character literals (a `//`
//!   inside a string stays): comments out, lines trimmed, blank lines dropped; preprocessor
//!   lines stay lines.
//! - **Cargo.toml** is parsed and written back without comments, benches and
//!   dev-dependencies (the bundle builds the binary, not the benchmarks or tests).

use anyhow::{Context, Result};
use quote::ToTokens;
use syn::visit_mut::VisitMut;

/// `bytes` of the file at `path` (relative), stripped by its kind for a build with `features`
/// (cargo features, as [`crate::runtime::build_info::BuildInfo`] lists them); other files
/// unchanged.
pub fn file(path: &str, bytes: &[u8], features: &[String]) -> Result<Vec<u8>> {
    let text = || std::str::from_utf8(bytes).with_context(|| format!("{path} is not UTF-8"));
    let ext = path.rsplit_once('.').map_or("", |(_, e)| e);
    Ok(match ext {
        "rs" => rust(text()?, features).with_context(|| format!("cannot parse {path}"))?.into_bytes(),
        "cu" | "cuh" | "cpp" | "h" | "c" | "hpp" => c_like(text()?).into_bytes(),
        _ if path == "Cargo.toml" => manifest(text()?).context("cannot parse Cargo.toml")?.into_bytes(),
        _ => bytes.to_vec(),
    })
}

/// A Rust file as the compiler reads it outside tests in a build with `features`, without
/// comments or indentation.
pub fn rust(src: &str, features: &[String]) -> Result<String> {
    let mut out = String::new();
    for line in kept_tokens(src, features)? {
        print(line, &mut out);
        out.push('\n');
    }
    Ok(out)
}

/// The tokens of a Rust file that a build with `features` compiles, one stream per line of
/// [`rust`]'s output: the file's inner attributes, then each top-level item.
fn kept_tokens(src: &str, features: &[String]) -> Result<Vec<proc_macro2::TokenStream>> {
    let mut file = syn::parse_file(src).map_err(|e| {
        let at = e.span().start();
        anyhow::anyhow!("{e} (line {}, column {})", at.line, at.column)
    })?;
    Strip { features }.visit_file_mut(&mut file);
    let attrs = file.attrs.iter().map(|a| without_docs(a.to_token_stream(), features)).filter(|t| !t.is_empty());
    Ok(attrs.chain(file.items.iter().map(|i| without_docs(i.to_token_stream(), features))).collect())
}

/// The last token printed, as far as the next one's spacing cares.
#[derive(Clone, Copy, PartialEq)]
enum Last {
    /// Nothing, an opening or closing delimiter, or a punctuation joined to the next token
    /// (`-` of `->`, `'` of `'a`): the next token follows with no space.
    Open,
    /// An identifier or keyword.
    Ident,
    /// A literal.
    Literal,
    /// A punctuation standing alone.
    Punct(char),
}

/// Pairs of characters that open or continue a multi-character token or a comment: a
/// punctuation standing alone is printed apart from the next one only when the two form one of
/// these (`a / *b`, `& &x`, `.. =` of `..=`), or one that rustc warns of (`- -b`, not `--b`).
const JOINING: [&str; 27] = [
    "--", "++", "&&", "||", "<<", ">>", "+=", "-=", "*=", "/=", "%=", "^=", "&=", "|=", "==", "!=", ">=", "<=", "->", "=>", "::", "..",
    ".=", "<-", "//", "/*", "*/",
];

/// Whether punctuation `a` standing alone and `b` after it would lex as something else printed
/// together.
fn joins(a: char, b: char) -> bool {
    JOINING.iter().any(|p| p.chars().eq([a, b]))
}

/// Prints tokens as rustc reads them back, with a space only where two tokens would otherwise
/// lex as one or as something else:
/// - two words (identifiers, keywords, literals): `let x`, `1 as`, `r "s"` (`r"s"` is a raw
///   string);
/// - two punctuations that would join ([`JOINING`]): `- -x`, `a / *b` (`/*` opens a comment),
///   `& &x`; `Spacing::Joint` marks the ones that do form one operator (`->`, `::`, `'a`),
///   printed together;
/// - a literal and a `.` (`1 .max(2)`: `1.` is a float);
/// - an identifier and `#` or `'` (`r#`, `b'` start raw and byte literals; `break 'outer`).
///
/// Everything else is printed together: `let x=a+b;`, `f(x)`, `a.b()`.
fn print(tokens: proc_macro2::TokenStream, out: &mut String) {
    print_after(tokens, out, Last::Open);
}

/// [`print`], after a token of kind `last`; returns the kind of the last token it printed.
fn print_after(tokens: proc_macro2::TokenStream, out: &mut String, mut last: Last) -> Last {
    use proc_macro2::{Delimiter, Spacing, TokenTree};
    for t in tokens {
        let space = match (&t, last) {
            (_, Last::Open) | (TokenTree::Group(_), _) => false,
            (TokenTree::Ident(_) | TokenTree::Literal(_), l) => !matches!(l, Last::Punct(_)),
            (TokenTree::Punct(p), Last::Punct(a)) => joins(a, p.as_char()),
            (TokenTree::Punct(p), Last::Literal) => p.as_char() == '.',
            (TokenTree::Punct(p), Last::Ident) => matches!(p.as_char(), '#' | '\''),
        };
        if space {
            out.push(' ');
        }
        last = match &t {
            TokenTree::Group(g) => {
                let (open, close) = match g.delimiter() {
                    Delimiter::Parenthesis => ("(", ")"),
                    Delimiter::Brace => ("{", "}"),
                    Delimiter::Bracket => ("[", "]"),
                    Delimiter::None => ("", ""),
                };
                out.push_str(open);
                let inner = print_after(g.stream(), out, if open.is_empty() { last } else { Last::Open });
                out.push_str(close);
                // An invisible group's last token may still join the next one.
                if open.is_empty() { inner } else { Last::Open }
            }
            TokenTree::Punct(p) => {
                out.push(p.as_char());
                if p.spacing() == Spacing::Joint || matches!(p.as_char(), ',' | ';') { Last::Open } else { Last::Punct(p.as_char()) }
            }
            TokenTree::Ident(i) => {
                out.push_str(&i.to_string());
                Last::Ident
            }
            TokenTree::Literal(l) => {
                out.push_str(&l.to_string());
                Last::Literal
            }
        };
    }
    last
}

/// `tokens` without doc attributes (`#[doc = ..]`, `#![doc = ..]`, macro bodies' too) and
/// without `cfg_attr`s that a build with `features` does not apply, at every depth.
fn without_docs(tokens: proc_macro2::TokenStream, features: &[String]) -> proc_macro2::TokenStream {
    use proc_macro2::{Group, TokenTree};
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    let mut out = Vec::with_capacity(trees.len());
    let mut i = 0;
    while i < trees.len() {
        if let TokenTree::Punct(p) = &trees[i]
            && p.as_char() == '#'
        {
            let inner = matches!(trees.get(i + 1), Some(TokenTree::Punct(b)) if b.as_char() == '!');
            let at = i + 1 + usize::from(inner);
            if let Some(TokenTree::Group(g)) = trees.get(at)
                && g.delimiter() == proc_macro2::Delimiter::Bracket
                && dropped(g.stream(), features)
            {
                i = at + 1;
                continue;
            }
        }
        out.push(match &trees[i] {
            TokenTree::Group(g) => {
                let mut n = Group::new(g.delimiter(), without_docs(g.stream(), features));
                n.set_span(g.span());
                TokenTree::Group(n)
            }
            t => t.clone(),
        });
        i += 1;
    }
    out.into_iter().collect()
}

/// Whether an attribute's bracketed tokens are a doc string or a `cfg_attr` that a build with
/// `features` does not apply.
fn dropped(attr: proc_macro2::TokenStream, features: &[String]) -> bool {
    let Ok(meta) = syn::parse2::<syn::Meta>(attr) else { return false };
    match &meta {
        syn::Meta::NameValue(nv) => nv.path.is_ident("doc"),
        syn::Meta::List(l) if l.path.is_ident("cfg_attr") => l
            .parse_args_with(syn::punctuated::Punctuated::<syn::Meta, syn::Token![,]>::parse_terminated)
            .is_ok_and(|p| p.first().and_then(|m| cfg_value(m, features)) == Some(false)),
        _ => false,
    }
}

/// Removes what a build with `features` and without `test` does not compile, at every level.
struct Strip<'a> {
    features: &'a [String],
}

impl Strip<'_> {
    /// Whether `attrs` keep their item out of this build.
    fn test_only(&self, attrs: &[syn::Attribute]) -> bool {
        attrs.iter().any(|a| {
            a.path().is_ident("test")
                || (a.path().is_ident("cfg") && a.parse_args::<syn::Meta>().is_ok_and(|m| cfg_value(&m, self.features) == Some(false)))
        })
    }
}

/// A `cfg` predicate's value in a build with `features` and without `test`: `Some(false)` where
/// it cannot hold, `Some(true)` where it must, `None` where it depends on anything else
/// (targets, other `cfg`s).
fn cfg_value(m: &syn::Meta, features: &[String]) -> Option<bool> {
    let list = |l: &syn::MetaList| -> Vec<syn::Meta> {
        l.parse_args_with(syn::punctuated::Punctuated::<syn::Meta, syn::Token![,]>::parse_terminated)
            .map(|p| p.into_iter().collect())
            .unwrap_or_default()
    };
    match m {
        syn::Meta::Path(p) if p.is_ident("test") => Some(false),
        syn::Meta::NameValue(nv) if nv.path.is_ident("feature") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => Some(features.iter().any(|f| *f == s.value())),
            _ => None,
        },
        syn::Meta::List(l) if l.path.is_ident("not") => list(l).first().and_then(|m| cfg_value(m, features)).map(|v| !v),
        // `all`: one false decides, all true holds; `any` the dual.
        syn::Meta::List(l) if l.path.is_ident("all") || l.path.is_ident("any") => {
            let decisive = l.path.is_ident("any");
            let vs: Vec<_> = list(l).iter().map(|m| cfg_value(m, features)).collect();
            if vs.contains(&Some(decisive)) {
                Some(decisive)
            } else if vs.iter().all(|v| *v == Some(!decisive)) {
                Some(!decisive)
            } else {
                None
            }
        }
        _ => None,
    }
}

/// An item's attributes, for the kinds that carry them.
fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item::*;
    match item {
        Const(i) => &i.attrs,
        Enum(i) => &i.attrs,
        ExternCrate(i) => &i.attrs,
        Fn(i) => &i.attrs,
        ForeignMod(i) => &i.attrs,
        Impl(i) => &i.attrs,
        Macro(i) => &i.attrs,
        Mod(i) => &i.attrs,
        Static(i) => &i.attrs,
        Struct(i) => &i.attrs,
        Trait(i) => &i.attrs,
        TraitAlias(i) => &i.attrs,
        Type(i) => &i.attrs,
        Union(i) => &i.attrs,
        Use(i) => &i.attrs,
        _ => &[],
    }
}

impl VisitMut for Strip<'_> {
    fn visit_file_mut(&mut self, f: &mut syn::File) {
        f.items.retain(|i| !self.test_only(item_attrs(i)));
        syn::visit_mut::visit_file_mut(self, f);
    }

    fn visit_item_mod_mut(&mut self, m: &mut syn::ItemMod) {
        if let Some((_, items)) = &mut m.content {
            items.retain(|i| !self.test_only(item_attrs(i)));
        }
        syn::visit_mut::visit_item_mod_mut(self, m);
    }

    fn visit_item_impl_mut(&mut self, i: &mut syn::ItemImpl) {
        i.items.retain(|it| match it {
            syn::ImplItem::Fn(f) => !self.test_only(&f.attrs),
            syn::ImplItem::Const(c) => !self.test_only(&c.attrs),
            syn::ImplItem::Type(t) => !self.test_only(&t.attrs),
            _ => true,
        });
        syn::visit_mut::visit_item_impl_mut(self, i);
    }

    fn visit_block_mut(&mut self, b: &mut syn::Block) {
        b.stmts.retain(|s| match s {
            syn::Stmt::Item(i) => !self.test_only(item_attrs(i)),
            syn::Stmt::Local(l) => !self.test_only(&l.attrs),
            _ => true,
        });
        syn::visit_mut::visit_block_mut(self, b);
    }

    fn visit_fields_named_mut(&mut self, f: &mut syn::FieldsNamed) {
        f.named = std::mem::take(&mut f.named).into_iter().filter(|x| !self.test_only(&x.attrs)).collect();
        syn::visit_mut::visit_fields_named_mut(self, f);
    }
}

/// C, C++ or CUDA without comments, each line trimmed, blank lines dropped.
pub fn c_like(src: &str) -> String {
    #[derive(PartialEq)]
    enum S {
        Code,
        Line,
        Block,
        Str(char),
    }
    let mut state = S::Code;
    let mut kept = String::with_capacity(src.len());
    let mut chars = src.chars().peekable();
    while let Some(c) = chars.next() {
        match state {
            S::Code => match (c, chars.peek()) {
                ('/', Some('/')) => {
                    chars.next();
                    state = S::Line;
                }
                ('/', Some('*')) => {
                    chars.next();
                    state = S::Block;
                    kept.push(' ');
                }
                ('"' | '\'', _) => {
                    kept.push(c);
                    state = S::Str(c);
                }
                _ => kept.push(c),
            },
            S::Line => {
                // A `\` at the end of a `//` comment's line continues the comment.
                if c == '\\' && chars.peek() == Some(&'\n') {
                    chars.next();
                } else if c == '\n' {
                    kept.push('\n');
                    state = S::Code;
                }
            }
            S::Block => {
                if c == '*' && chars.peek() == Some(&'/') {
                    chars.next();
                    state = S::Code;
                } else if c == '\n' {
                    kept.push('\n');
                }
            }
            S::Str(q) => {
                kept.push(c);
                if c == '\\' {
                    if let Some(n) = chars.next() {
                        kept.push(n);
                    }
                } else if c == q || c == '\n' {
                    state = S::Code;
                }
            }
        }
    }
    let mut out = String::with_capacity(kept.len());
    for line in kept.lines().map(str::trim).filter(|l| !l.is_empty()) {
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Cargo.toml without comments, `[[bench]]` targets or `[dev-dependencies]`.
pub fn manifest(src: &str) -> Result<String> {
    let mut table: toml::Table = toml::from_str(src)?;
    table.remove("bench");
    table.remove("dev-dependencies");
    Ok(toml::to_string(&table)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_keeps_the_program_and_drops_comments_docs_and_tests() {
        let src = r#"//! Module docs.
/// A doc.
#[derive(Debug)]
pub struct A {
    /// Field doc.
    pub x: u32, // trailing comment
    #[cfg(test)]
    pub probe: u32,
}

/* block */ fn f() -> &'static str {
    #[cfg(test)]
    let y = 1;
    "// not a comment" // a remark
}

#[cfg(test)]
mod tests {
    #[test]
    fn t() {}
}

#[cfg(all(test, feature = "gpu"))]
fn gpu_test() {}

#[cfg(feature = "gpu")]
fn gpu() {}

#[cfg(not(test))]
fn always() {}

#[cfg(any(test, test))]
fn any_test() {}

#[cfg(any(test, feature = "gpu"))]
fn maybe() {}

#[cfg(not(feature = "gpu"))]
fn without_gpu() {}

#[cfg_attr(test, derive(Clone))]
struct B;

impl A {
    #[cfg(test)]
    fn only_in_tests(&self) {}
    fn kept(&self) -> bool { let chained = Some(1); if let Some(v) = chained && v > 0 { return true } false }
}
"#;
        let gpu = ["gpu".to_string()];
        let out = rust(src, &gpu).unwrap();
        for gone in [
            "docs",
            "doc",
            "remark",
            "trailing",
            "block",
            "probe",
            "tests",
            "gpu_test",
            "only_in_tests",
            "Clone",
            "let y",
            "any_test",
            "without_gpu",
        ] {
            assert!(!out.contains(gone), "{gone:?} is still in:\n{out}");
        }
        for kept in ["\"// not a comment\"", "derive(Debug)", "fn gpu", "fn always", "fn maybe", "fn kept", "'static", "struct B"] {
            assert!(out.contains(kept), "{kept:?} is missing from:\n{out}");
        }
        assert!(!out.contains("    "), "indentation kept:\n{out}");
        // What is printed parses again to the same program.
        let again = rust(&out, &gpu).unwrap();
        assert_eq!(again, out);
        assert!(rust("fn (", &gpu).unwrap_err().to_string().contains("line 1"));
        // A build without the feature keeps what it compiles instead.
        let lean = rust(src, &[]).unwrap();
        assert!(lean.contains("fn without_gpu") && !lean.contains("fn gpu") && !lean.contains("fn maybe"), "{lean}");
    }

    #[test]
    fn c_like_knows_strings_and_keeps_preprocessor_lines() {
        let src = "#include <a.cuh> // the header\n/* a\n block */ int x = 1;\n\n    const char* s = \"http://x /* no */\"; char c = '\\'';\n#define M(a) \\\n    (a + 1) // done\n";
        assert_eq!(
            c_like(src),
            "#include <a.cuh>\nint x = 1;\nconst char* s = \"http://x /* no */\"; char c = '\\'';\n#define M(a) \\\n(a + 1)\n"
        );
    }

    #[test]
    fn the_manifest_loses_comments_benches_and_dev_dependencies() {
        let src = "# top\n[package]\nname = \"p\" # the name\n\n[dependencies]\na = \"1\"\n\n[dev-dependencies]\nb = \"2\"\n\n[[bench]]\nname = \"x\"\n";
        let out = manifest(src).unwrap();
        assert!(out.contains("name = \"p\"") && out.contains("a = \"1\""), "{out}");
        for gone in ["#", "bench", "dev-dependencies", "b = "] {
            assert!(!out.contains(gone), "{gone} in {out}");
        }
    }

    /// Tokens flattened to (kind and text, joined to the next), groups as their delimiters:
    /// what the compiler reads, whatever the spacing.
    fn flat(tokens: proc_macro2::TokenStream, into: &mut Vec<(String, bool)>) {
        use proc_macro2::TokenTree;
        for t in tokens {
            match t {
                TokenTree::Group(g) => {
                    into.push((format!("open {:?}", g.delimiter()), false));
                    flat(g.stream(), into);
                    into.push((format!("close {:?}", g.delimiter()), false));
                }
                TokenTree::Ident(i) => into.push((format!("ident {i}"), false)),
                TokenTree::Punct(p) => into.push((format!("punct {}", p.as_char()), p.spacing() == proc_macro2::Spacing::Joint)),
                TokenTree::Literal(l) => into.push((format!("literal {l}"), false)),
            }
        }
    }

    /// `printed` lexes back to the tokens `src` keeps, and two punctuations that would form
    /// another token ([`JOINING`]) touch only where they did in the source: the same program
    /// to rustc.
    fn lexes_back(src: &str, printed: &str, features: &[String]) -> std::result::Result<(), String> {
        let (mut want, mut got) = (Vec::new(), Vec::new());
        for line in kept_tokens(src, features).unwrap() {
            flat(line, &mut want);
        }
        flat(printed.parse().map_err(|e| format!("does not lex: {e}"))?, &mut got);
        if let Some(i) = (0..want.len().max(got.len())).find(|&i| want.get(i).map(|w| &w.0) != got.get(i).map(|g| &g.0)) {
            return Err(format!("token {i}: {:?} printed as {:?}", want.get(i), got.get(i)));
        }
        let punct = |t: &(String, bool)| t.0.strip_prefix("punct ").and_then(|c| c.chars().next());
        for (i, pair) in got.windows(2).enumerate() {
            if let (Some(a), Some(b)) = (punct(&pair[0]), punct(&pair[1]))
                && pair[0].1
                && !want[i].1
                && joins(a, b)
            {
                return Err(format!("token {i}: `{a}` and `{b}` touch in the printed text, not in the source"));
            }
        }
        Ok(())
    }

    #[test]
    fn tokens_are_printed_apart_only_where_they_would_join() {
        let src = "fn f<'a>(x: &'a [u8], y: i32) -> i32 { let z = - -y; let w = 1 .max(2) + 1.0f32 as i32; \
                   let p = & &x; let q = y / *&y; let r = r\"raw\"; let s = b'x'; 'outer: loop { break 'outer; } \
                   let t = 0..=3; let u = ..; let v = x.len() >> 1; if y <= -1 && !(y == 2) || y != 3 { return w } z }";
        let out = rust(src, &[]).unwrap();
        for kept in ["- -y", "1 .max(2)", "& &x", "/ *&y", "r\"raw\"", "b'x'", "break 'outer", "0 ..=3", "let z=", "x:&'a[u8]", "->i32{"] {
            assert!(out.contains(kept), "{kept:?} is missing from:\n{out}");
        }
        lexes_back(src, &out, &[]).unwrap();
        // The check itself fails on a printing that joins what must stay apart.
        assert!(lexes_back(src, &out.replace("/ *&y", "/*&y"), &[]).is_err());
        assert!(lexes_back(src, &out.replace("& &x", "&&x"), &[]).is_err());
    }

    /// Every Rust file of this crate parses, loses at least its comments, and prints back to
    /// the tokens it kept.
    #[test]
    fn every_source_file_of_the_crate_strips() {
        let s = super::super::sources::of_this_binary().unwrap();
        let features = crate::runtime::build_info::BuildInfo::this().features;
        for f in &s.files {
            let bytes = std::fs::read(s.root.join(f)).unwrap();
            let out = file(f, &bytes, &features).unwrap_or_else(|e| panic!("{f}: {e:#}"));
            assert!(out.len() < bytes.len(), "{f}: {} -> {}", bytes.len(), out.len());
            if f.ends_with(".rs") {
                let src = std::str::from_utf8(&bytes).unwrap();
                lexes_back(src, std::str::from_utf8(&out).unwrap(), &features).unwrap_or_else(|e| panic!("{f}: {e}"));
            }
        }
    }
}

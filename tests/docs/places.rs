//! "Adding a backend is its folder and two lines of backend/mod.rs"
//! (docs/design.md), checked:
//! the places in `src/` outside a backend's folder that name it.
//!
//! A place names a backend when its code (not its comments, not its
//! `#[cfg(test)]` items, not a test module's file) holds
//! - a path through it (`lvm::`),
//! - an identifier with its name as one of its words (`is_iscsi_name`,
//!   `DeviceKind::Rbd`, `SKIP_RBD`; for `file`, a word of plain English,
//!   only its types `FileBackend` and `FileSettings`),
//! - or a string that is its name, or starts with it and a `.` or `-`
//!   (`"rbd"`, a kill point's `"iscsi.held"`, `"lvm-helper"`).

use super::root;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The places besides `src/backend/mod.rs` (its `mod` and its line in
/// `KINDS`) that may name a backend, and why. A place that stops naming
/// it must leave this list too: the test compares both ways.
const KNOWN: &[(&str, &str, &str)] = &[(
    "nfs",
    "src/mount/helper.rs",
    "the kernel's nfs filesystem (its types nfs and nfs4, its mount helpers and \
         superblock sharing), which any backend that mounts NFS would meet",
)];

/// A source file's code as tokens: the code with comments removed and
/// each string literal replaced by `"<n>"`, and the literals' contents.
fn lex(src: &str) -> (String, Vec<String>) {
    let b = src.as_bytes();
    let (mut code, mut strings) = (String::new(), Vec::new());
    let mut i = 0;
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    // Whether the `r` at `i` begins a token (or follows a lone `b`).
    let starts_token = |i: usize| match i {
        0 => true,
        _ if !ident(b[i - 1]) => true,
        1 => b[0] == b'b',
        _ => b[i - 1] == b'b' && !ident(b[i - 2]),
    };
    while i < b.len() {
        let c = b[i];
        if src[i..].starts_with("//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if src[i..].starts_with("/*") {
            let mut depth = 0;
            while i < b.len() {
                if src[i..].starts_with("/*") {
                    depth += 1;
                    i += 2;
                } else if src[i..].starts_with("*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == b'\n' {
                        code.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == b'r' && starts_token(i) && matches!(b.get(i + 1), Some(b'"' | b'#')) {
            // A raw string: r"..." or r#"..."# (br"..." too).
            let hashes = src[i + 1..].bytes().take_while(|&h| h == b'#').count();
            if b.get(i + 1 + hashes) != Some(&b'"') {
                code.push(c as char);
                i += 1;
                continue;
            }
            let start = i + 2 + hashes;
            let end_mark = format!("\"{}", "#".repeat(hashes));
            let len = src[start..].find(&end_mark).expect("raw string ends");
            code.push_str(&format!("\"{}\"", strings.len()));
            code.extend(std::iter::repeat_n(
                '\n',
                src[start..start + len].matches('\n').count(),
            ));
            strings.push(src[start..start + len].to_string());
            i = start + len + end_mark.len();
        } else if c == b'"' {
            let mut j = i + 1;
            while b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let text = &src[i + 1..j];
            code.push_str(&format!("\"{}\"", strings.len()));
            code.extend(std::iter::repeat_n('\n', text.matches('\n').count()));
            strings.push(text.to_string());
            i = j + 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '"'), or a lifetime ('a).
            let lit = match b.get(i + 1) {
                // The escaped character may be a quote: look past it.
                Some(b'\\') => src[i + 3..].find('\'').map(|n| i + 3 + n + 1),
                Some(_) => {
                    let ch = src[i + 1..].chars().next().unwrap();
                    let after = i + 1 + ch.len_utf8();
                    (b.get(after) == Some(&b'\'')).then_some(after + 1)
                }
                None => None,
            };
            match lit {
                Some(end) => {
                    code.push_str("' '");
                    i = end;
                }
                None => {
                    code.push('\'');
                    i += 1;
                }
            }
        } else {
            let ch = src[i..].chars().next().unwrap();
            code.push(ch);
            i += ch.len_utf8();
        }
    }
    (code, strings)
}

/// The code without its `#[cfg(test)]` items (a module, a function, a
/// `use`), newlines kept.
fn without_tests(code: &str) -> String {
    let mark = "#[cfg(test)]";
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find(mark) {
        out.push_str(&rest[..at]);
        let item = &rest[at + mark.len()..];
        let (mut depth, mut end) = (0, item.len());
        for (n, ch) in item.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = n + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = n + 1;
                    break;
                }
                _ => {}
            }
        }
        out.extend(std::iter::repeat_n('\n', item[..end].matches('\n').count()));
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// An identifier's words: `is_iscsi_name` is, iscsi, name; `DeviceKind`
/// device, kind; `RBD_PART_SHIFT` rbd, part, shift; all lower case.
fn words(ident: &str) -> Vec<String> {
    let mut words = Vec::new();
    for part in ident.split('_').filter(|p| !p.is_empty()) {
        let chars: Vec<char> = part.chars().collect();
        let mut word = String::new();
        for (n, &ch) in chars.iter().enumerate() {
            let upper_starts = ch.is_uppercase()
                && !word.is_empty()
                && (chars[n - 1].is_lowercase()
                    || chars.get(n + 1).is_some_and(|next| next.is_lowercase()));
            if upper_starts {
                words.push(std::mem::take(&mut word).to_lowercase());
            }
            word.push(ch);
        }
        words.push(word.to_lowercase());
    }
    words
}

/// The lines of `src` (a Rust file's text) whose code names `backend`.
fn naming(src: &str, backend: &str) -> Vec<usize> {
    let (code, strings) = lex(src);
    let code = without_tests(&code);
    let mut lines = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let mut tokens = line
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '"' || c == ':'))
            .filter(|t| !t.is_empty());
        let names = tokens.any(|t| {
            // A literal's placeholder, after its prefix if any (b"...").
            if let Some(k) = t.split_once('"').and_then(|(_, t)| t.split('"').next()) {
                let s = k.parse::<usize>().map_or("", |k| strings[k].as_str());
                return s == backend
                    || s.strip_prefix(backend)
                        .is_some_and(|r| r.starts_with(['.', '-']));
            }
            let segments = t.split("::").count();
            t.split("::").any(|part| {
                let path = segments > 1 && part == backend;
                let word = match backend {
                    "file" => part == "FileBackend" || part == "FileSettings",
                    _ => words(part).iter().any(|w| w == backend),
                };
                path || word
            })
        });
        if names {
            lines.push(n + 1);
        }
    }
    lines
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn the_lexer_and_the_words_see_what_the_count_needs() {
    assert_eq!(words("is_iscsi_name"), ["is", "iscsi", "name"]);
    assert_eq!(words("DeviceKind"), ["device", "kind"]);
    assert_eq!(words("RBD_PART_SHIFT"), ["rbd", "part", "shift"]);
    assert_eq!(words("LvmHelper"), ["lvm", "helper"]);
    assert_eq!(words("HTTPServer"), ["http", "server"]);
    let src = "// rbd here\nlet a = \"rbd\"; /* lvm */ let b = 'x';\n#[cfg(test)]\nmod t { use lvm::X; }\nfn f<'a>(s: &'a str) -> &str { r#\"iscsi.held\"# }\nfn is_nfs() {}\nlet m = \"lvm volumes\";\n";
    assert_eq!(naming(src, "rbd"), [2]);
    assert_eq!(naming(src, "lvm"), Vec::<usize>::new());
    assert_eq!(naming(src, "iscsi"), [5]);
    assert_eq!(naming(src, "nfs"), [6]);
    assert_eq!(naming("use super::lvm::library;", "lvm"), [1]);
    assert_eq!(naming("use crate::backend::file;", "file"), [1]);
    assert_eq!(naming("let q = '\\''; let s = \"rbd\";", "rbd"), [1]);
    assert_eq!(naming("let s = br\"lvm\"; let t = b'\"';", "lvm"), [1]);
    assert_eq!(
        naming("let file = x.file_name(); File::open(p)", "file"),
        Vec::<usize>::new()
    );
    assert_eq!(naming("Arc::new(FileBackend::new())", "file"), [1]);
}

#[test]
fn a_backend_is_named_in_src_only_by_its_folder_and_backend_mod_rs() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    files.sort();
    let mut found: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    let mut lines = Vec::new();
    for kind in ferrovol::backend::KINDS {
        let own = format!("src/backend/{}/", kind.name);
        let places = found.entry(kind.name).or_default();
        for f in &files {
            let rel = f
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            // Test modules' own files (`#[cfg(test)] mod tests;`).
            let test_file = rel.contains("/tests/") || rel.ends_with("/tests.rs");
            if rel.starts_with(&own) || test_file {
                continue;
            }
            let at = naming(&std::fs::read_to_string(f).unwrap(), kind.name);
            if !at.is_empty() {
                lines.push(format!("{}: {rel}:{at:?}", kind.name));
                places.insert(rel);
            }
        }
    }
    let mut expected: BTreeMap<&str, BTreeSet<String>> = ferrovol::backend::KINDS
        .iter()
        .map(|k| (k.name, BTreeSet::from(["src/backend/mod.rs".to_string()])))
        .collect();
    for (backend, place, _why) in KNOWN {
        expected.get_mut(backend).unwrap().insert(place.to_string());
    }
    for (backend, places) in &found {
        println!(
            "{backend}: {} place(s) outside its folder: {places:?}",
            places.len()
        );
    }
    assert_eq!(
        found,
        expected,
        "the places that name a backend outside its folder are not the known ones:\n{}",
        lines.join("\n")
    );
}

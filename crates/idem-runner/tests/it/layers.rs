//! The runner's modules form layers: a module uses only modules of layers below its own, so no import runs
//! back up and no two modules import each other. [`LAYERS`] is the order (ARCHITECTURE.md states it); a
//! module of the crate missing from it fails the test, so a new one is placed on purpose.
//!
//! Read from the source, not the compiler: every `crate::NAME` path (in `use` lines, `use crate::{…}` groups
//! and inline paths) outside comments and `mod tests` is an import of the module that defines `NAME`, names
//! re-exported by `lib.rs` resolved to the module they come from.
//!
//! Run alone: `cargo test -p idem-runner --test it layers`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The runner's top-level modules, bottom layer first; a module may import only from earlier layers.
const LAYERS: &[&[&str]] = &[
    &["error", "shown"],
    &["items", "output", "supervise", "queue_url"],
    &["queue", "admin", "summary"],
    &["config"],
    &["progress", "report", "job"],
    &["engine", "once"],
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The text of a file without comments and without its `#[cfg(test)] mod tests` (tests may reach anywhere).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]" && lines.peek().is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            break;
        }
        let line = line.split("//").next().unwrap_or_default();
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The first path segment of each item of a `use` group's braces: `{Error, items::parse_item}` → `Error`,
/// `items`.
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut item = String::new();
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => heads.push(std::mem::take(&mut item)),
            _ if depth == 0 => item.push(c),
            _ => {}
        }
    }
    heads.push(item);
    heads
        .iter()
        .filter_map(|i| i.trim().split("::").next().map(str::trim).filter(|h| !h.is_empty()).map(str::to_owned))
        .filter(|h| h != "self")
        .collect()
}

/// The names a text reaches through `prefix` (`crate::` or `super::`): the first segment after it, or each
/// head of a braced group after it.
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find("};").or_else(|| group.find('}')).unwrap_or(group.len());
            // Nested groups: take up to the brace that closes this one.
            let mut depth = 1;
            let mut close = end;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            close = i;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            names.extend(group_heads(&group[..close]));
        } else {
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                names.push(name);
            }
        }
    }
    names
}

/// The crate's top-level modules: `src/NAME.rs` and `src/NAME/`.
fn modules() -> BTreeSet<String> {
    std::fs::read_dir(src())
        .expect("src")
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() {
                Some(name)
            } else {
                name.strip_suffix(".rs").filter(|n| *n != "lib").map(str::to_owned)
            }
        })
        .collect()
}

/// The `.rs` files of a module (its file, or every file under its directory).
fn files(module: &str) -> Vec<PathBuf> {
    let dir = src().join(module);
    if !dir.is_dir() {
        return vec![src().join(format!("{module}.rs"))];
    }
    let mut found = Vec::new();
    let mut todo = vec![dir];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("module directory").flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                found.push(p);
            }
        }
    }
    found.sort();
    found
}

/// What `lib.rs` re-exports, by name: the module each comes from (`pub use config::{RunConfig, …}`).
fn reexports(modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let lib = code(&src().join("lib.rs"));
    let mut map = BTreeMap::new();
    for statement in lib.split(';') {
        let statement = statement.trim();
        let Some(path) = statement.strip_prefix("pub use ").or_else(|| statement.strip_prefix("use ")) else {
            continue;
        };
        let Some((module, rest)) = path.split_once("::") else { continue };
        if !modules.contains(module) {
            continue;
        }
        let rest = rest.trim();
        let names = match rest.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
            Some(group) => group_heads(group),
            None => vec![rest.rsplit("::").next().unwrap_or(rest).trim().to_owned()],
        };
        for name in names {
            // `a::B` inside the group names `B`.
            let name = name.rsplit("::").next().unwrap_or(&name).to_owned();
            map.insert(name, module.to_owned());
        }
    }
    map
}

/// Each module's imports of other modules, with the names that made them.
fn imports() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let modules = modules();
    let reexported = reexports(&modules);
    let mut graph = BTreeMap::new();
    for module in &modules {
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in files(module) {
            for name in paths_after(&code(&file), "crate::") {
                let target = if modules.contains(&name) {
                    name.clone()
                } else if let Some(m) = reexported.get(&name) {
                    m.clone()
                } else {
                    panic!("{}: crate::{name} is neither a module nor re-exported by lib.rs", file.display());
                };
                if &target != module {
                    let shown = format!("{}: crate::{name}", file.strip_prefix(src()).unwrap_or(&file).display());
                    edges.entry(target).or_default().insert(shown);
                }
            }
        }
        graph.insert(module.clone(), edges);
    }
    graph
}

#[test]
fn every_module_imports_only_from_the_layers_below_it() {
    let layer_of: BTreeMap<&str, usize> =
        LAYERS.iter().enumerate().flat_map(|(i, layer)| layer.iter().map(move |m| (*m, i))).collect();
    let graph = imports();
    let unplaced: Vec<&String> = graph.keys().filter(|m| !layer_of.contains_key(m.as_str())).collect();
    assert!(unplaced.is_empty(), "modules not in LAYERS (place each in a layer): {unplaced:?}");
    let mut upward = Vec::new();
    for (module, edges) in &graph {
        for (target, why) in edges {
            if layer_of[target.as_str()] >= layer_of[module.as_str()] {
                upward.push(format!("{module} -> {target} ({})", why.iter().cloned().collect::<Vec<_>>().join(", ")));
            }
        }
    }
    assert!(upward.is_empty(), "imports running up or across a layer:\n{}", upward.join("\n"));
}

/// The files of each folder module (`engine/`, `once/`, …) import each other in one direction: a file reaches
/// its siblings through `super::NAME`, and no chain of such imports comes back to where it started. (`mod.rs`
/// is the folder's face: its children may use what it defines.)
#[test]
fn no_files_of_a_folder_import_each_other_in_a_loop() {
    let mut loops = Vec::new();
    for dir in std::fs::read_dir(src()).expect("src").flatten().map(|e| e.path()).filter(|p| p.is_dir()) {
        let siblings: BTreeSet<String> = std::fs::read_dir(&dir)
            .expect("module directory")
            .flatten()
            .filter_map(|e| e.file_name().to_string_lossy().strip_suffix(".rs").map(str::to_owned))
            .filter(|n| n != "mod")
            .collect();
        let edges: BTreeMap<String, BTreeSet<String>> = siblings
            .iter()
            .map(|file| {
                let text = code(&dir.join(format!("{file}.rs")));
                let to = paths_after(&text, "super::").into_iter().filter(|n| siblings.contains(n) && n != file);
                (file.clone(), to.collect())
            })
            .collect();
        // Depth-first from each file: a path that meets itself again is a loop.
        for start in &siblings {
            let mut todo = vec![vec![start.clone()]];
            while let Some(path) = todo.pop() {
                let last = path.last().expect("a path has a file");
                for next in &edges[last] {
                    if next == start {
                        let folder = dir.file_name().unwrap_or_default().to_string_lossy();
                        loops.push(format!("{folder}/: {} -> {start}", path.join(" -> ")));
                    } else if !path.contains(next) && next > start {
                        // Only loops whose smallest file is `start`: each is reported once.
                        let mut longer = path.clone();
                        longer.push(next.clone());
                        todo.push(longer);
                    }
                }
            }
        }
    }
    assert!(loops.is_empty(), "files importing each other in a loop:\n{}", loops.join("\n"));
}

#!/usr/bin/env python3
"""Import circles between the files of a crate: exits 1 and names them.

    scripts/import-circles.py dedupe-core dedupe-cli

Each file of `src/` is a module (`mod.rs`, `lib.rs` and `main.rs` are their
directory's). A module depends on another when its code (not its comments,
not its `#[cfg(test)]` part) names a path into it: `crate::a::b`,
`super::x`, a `use` group, or a child declared with `mod x;` and used as
`x::...`. A path resolves to the deepest module it names. Circles are the
strongly connected sets of that graph (Tarjan's algorithm). The crate root
(`lib.rs`, `main.rs`) is left out: it declares the modules and re-exports
their names, so every module "depends" on it and it on every module.
"""
import os
import re
import sys

PATH = re.compile(r"(?<!\()\b(crate|super)((?:::\w+)*)(::\{([^}]*)\})?")
CHILD = re.compile(r"^\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+(\w+)\s*;", re.M)


def modules(src):
    found = {}
    for folder, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                parts = os.path.relpath(os.path.join(folder, name), src)[:-3].split(os.sep)
                if parts[-1] in ("mod", "lib", "main"):
                    parts = parts[:-1]
                with open(os.path.join(folder, name)) as f:
                    found[tuple(parts)] = f.read()
    return found


def code_of(text):
    code = "\n".join(line.split("//")[0] for line in text.split("\n"))
    cut = code.find("#[cfg(test)]")
    return code if cut < 0 else code[:cut]


def graph(found):
    def resolve(path):
        for n in range(len(path), -1, -1):
            if tuple(path[:n]) in found:
                return tuple(path[:n])
        return ()

    edges = {}
    for module, text in found.items():
        code = code_of(text)
        targets = set()
        for m in PATH.finditer(code):
            base = [] if m.group(1) == "crate" else list(module[:-1])
            segments = [s for s in m.group(2).split("::") if s]
            if m.group(4) is None:
                targets.add(resolve(base + segments))
                continue
            for item in m.group(4).split(","):
                tail = [s for s in item.strip().split("::") if s and s != "self"]
                if tail:
                    targets.add(resolve(base + segments + tail))
        for child in CHILD.findall(code):
            if re.search(r"(?<![:\w])" + child + r"::", code):
                targets.add(resolve(list(module) + [child]))
        targets.discard(module)
        targets.discard(())
        if module != ():
            edges[module] = targets
    return edges


def circles(edges):
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(group)

    sys.setrecursionlimit(10_000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def main(crates):
    name = lambda m: "::".join(m) or "crate"
    bad = 0
    for crate in crates:
        edges = graph(modules(os.path.join(crate, "src")))
        for group in circles(edges):
            bad += 1
            print(f"{crate}: import circle: {', '.join(name(m) for m in group)}")
            for m in group:
                inside = ", ".join(name(t) for t in edges[m] if t in group)
                print(f"    {name(m)} -> {inside}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

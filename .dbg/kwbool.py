import ast, importlib, inspect, pathlib, sys
SKIP_FILES = ("_attention_kernels.py", "flagos/delayed_scaling.py", "flagos/_blockwise.py")
done, skipped = [], []
for p in sorted(pathlib.Path("transformer_engine").rglob("*.py")):
    if any(s in str(p) for s in SKIP_FILES): continue
    text = p.read_text(); tree = ast.parse(text)
    modname = str(p)[:-3].replace("/", ".").removesuffix(".__init__")
    lines = text.splitlines(keepends=True); offs = [0]
    for l in lines: offs.append(offs[-1] + len(l))
    parents = {}
    for node in ast.walk(tree):
        for c in ast.iter_child_nodes(node): parents[c] = node
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call): continue
        idx = [i for i, a in enumerate(node.args) if isinstance(a, ast.Constant) and isinstance(a.value, bool)]
        fn = ast.unparse(node.func)
        if fn == "gemm" and "reference" in str(p) and len(node.args) > 4: idx = [2]
        if not idx: continue
        try:
            mod = importlib.import_module(modname)
            if isinstance(node.func, ast.Name):
                obj = getattr(mod, fn)
            elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
                cls = parents[node]
                while not isinstance(cls, ast.ClassDef): cls = parents[cls]
                obj = getattr(getattr(mod, cls.name), node.func.attr)
            else:
                raise LookupError(fn)
            params = list(inspect.signature(obj).parameters.values())
            if params and params[0].name == "self" and not isinstance(node.func, ast.Name): params = params[1:]
            if isinstance(obj, type) and params and params[0].name == "self": params = params[1:]
        except Exception as e:
            skipped.append(f"{p}:{node.lineno} {fn} ({type(e).__name__})"); continue
        first = min(idx)
        if any(pp.kind in (pp.VAR_POSITIONAL, pp.POSITIONAL_ONLY) for pp in params[:len(node.args)]):
            skipped.append(f"{p}:{node.lineno} {fn} (positional-only)"); continue
        for i, a in enumerate(node.args[first:], start=first):
            edits.append((offs[a.lineno - 1] + a.col_offset, params[i].name))
        done.append(f"{p}:{node.lineno} {fn}")
    if edits and "--write" in sys.argv:
        for pos, name in sorted(edits, reverse=True): text = text[:pos] + f"{name}=" + text[pos:]
        p.write_text(text)
print("DONE"); print("\n".join(done)); print("SKIPPED"); print("\n".join(skipped))

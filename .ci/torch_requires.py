"""Print the installed torch's requirements, one per line, without markers:
`own` all but the CUDA runtime libraries (nvidia-*, cuda-*), `cuda` only those, and
`cuda-from FILE` this torch's CUDA libraries at the versions FILE pins (a `cuda` listing of
another torch): a library both torches need comes at the other's version, with the extras
of both (cuda-toolkit[...]: a library only this torch loads, e.g. curand for torch 2.11,
is added to the other's release); one the other does not list keeps this torch's pin."""
import importlib.metadata as md
import re
import sys


def parse(spec):
    """(name, extras, version part) of a requirement without markers."""
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[([^\]]*)\])?\s*(.*)$", spec)
    extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
    return m.group(1).lower(), extras, m.group(3).replace(" ", "")


def requirements(cuda):
    out = []
    for r in md.requires("torch") or []:
        spec, _, marker = r.partition(";")
        if "extra" in marker:
            continue
        name, _, _ = parse(spec)
        if name.startswith(("nvidia-", "cuda-")) == cuda:
            out.append(spec.strip())
    return out


def fmt(name, extras, version):
    return name + (f"[{','.join(sorted(extras))}]" if extras else "") + version


which = sys.argv[1]
if which == "own":
    print("\n".join(s.replace(" ", "") for s in requirements(False)))
elif which == "cuda":
    print("\n".join(s.replace(" ", "") for s in requirements(True)))
elif which == "cuda-from":
    theirs = {}
    with open(sys.argv[2]) as f:
        for line in f:
            if line.strip():
                name, extras, version = parse(line)
                theirs[name] = (extras, version)
    for spec in requirements(True):
        name, extras, version = parse(spec)
        if name in theirs:
            print(fmt(name, extras | theirs[name][0], theirs[name][1]))
        else:
            print(fmt(name, extras, version))
else:
    sys.exit(f"torch_requires.py: unknown listing {which!r} (own, cuda, cuda-from FILE)")

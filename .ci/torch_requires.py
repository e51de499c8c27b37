"""Print the installed torch's requirements, one per line, without markers or extras:
`own` all but the CUDA runtime libraries (nvidia-*, cuda-*), `cuda` only those."""
import importlib.metadata as md
import re
import sys

which = sys.argv[1]
for r in md.requires("torch") or []:
    spec, _, marker = r.partition(";")
    if "extra" in marker:
        continue
    name = re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0].lower()
    cuda = name.startswith(("nvidia-", "cuda-"))
    if cuda == (which == "cuda"):
        print(spec.replace(" ", ""))

"""DNABERT-2's reference code (the remote code of zhihan1996/DNABERT-2-117M: bert_layers.py,
bert_padding.py, configuration_bert.py; MosaicBERT) for the Python peers of tests/hf. It is
not part of this repository: give its folder with --dnabert2-ref DIR or DNALLM_DNABERT2_REF
(a copy of the model repository's .py files, e.g. from the Hugging Face hub or a public mirror).
Without it the DNABERT-2 families are skipped with a message (CI cannot fetch them).

install(ref, model_dir) puts the code next to a model directory the way the hub ships it, with
two shims so that it runs under current transformers on a CPU (both keep its computation):
  * flash_attn_triton.py is replaced by a module that raises ImportError: the reference then
    takes its PyTorch attention path (its Triton kernel needs a GPU and an old Triton);
  * BertEncoder.rebuild_alibi_tensor builds its table on the CPU when given no device:
    transformers 5 constructs models on the meta device, where the original line fails
    ("Tensor on device meta is not on the expected device cpu").
It needs einops (pip install einops), which bert_layers.py imports.
"""
import hashlib
import os
import shutil
import sys

CODE_FILES = ["bert_layers.py", "bert_padding.py", "configuration_bert.py"]
FLASH_STUB = ('raise ImportError("flash_attn_triton stub (tests/hf/dnabert2_reference.py): the '
              'reference runs its PyTorch attention path")\n')
ALIBI_OLD = "        n_heads = self.num_attention_heads\n"
ALIBI_NEW = ("        n_heads = self.num_attention_heads\n"
             "        if device is None:  # dnallm shim: not the meta device of transformers 5\n"
             "            device = 'cpu'\n")
PATCHES = ["flash_attn_triton.py replaced by a module raising ImportError (PyTorch attention "
           "path)",
           "bert_layers.py BertEncoder.rebuild_alibi_tensor: device None -> 'cpu' (transformers 5 "
           "builds models on the meta device)"]


def reference_dir(cli_value=None):
    """The reference folder from --dnabert2-ref or DNALLM_DNABERT2_REF, or None."""
    path = cli_value or os.environ.get("DNALLM_DNABERT2_REF", "")
    if not path:
        return None
    missing = [f for f in CODE_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        sys.exit(f"FAIL: DNABERT-2 reference folder {path} lacks {', '.join(missing)}: give the "
                 "folder holding zhihan1996/DNABERT-2-117M's .py files")
    try:
        import einops  # noqa: F401  (bert_layers.py needs it)
    except ImportError:
        sys.exit(f"FAIL: {sys.executable} cannot import einops, which DNABERT-2's bert_layers.py "
                 "imports: pip install einops")
    return path


SKIP_MESSAGE = ("DNABERT-2 families skipped: no reference code (give --dnabert2-ref DIR or "
                "DNALLM_DNABERT2_REF with zhihan1996/DNABERT-2-117M's .py files)")


def install(ref, model_dir):
    """Copies the reference code into model_dir with the shims above."""
    for f in CODE_FILES:
        shutil.copyfile(os.path.join(ref, f), os.path.join(model_dir, f))
    path = os.path.join(model_dir, "bert_layers.py")
    with open(path) as f:
        text = f.read()
    if "dnallm shim" not in text:
        assert text.count(ALIBI_OLD) == 1, f"{path}: rebuild_alibi_tensor is not the expected one"
        text = text.replace(ALIBI_OLD, ALIBI_NEW, 1)
        with open(path, "w") as f:
            f.write(text)
    with open(os.path.join(model_dir, "flash_attn_triton.py"), "w") as f:
        f.write(FLASH_STUB)


def code_digest(ref):
    """sha256 of the unpatched reference files, for fixture.json."""
    return {f: hashlib.sha256(open(os.path.join(ref, f), "rb").read()).hexdigest()
            for f in CODE_FILES}


def is_dnabert2(model_dir):
    import json
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        c = json.load(f)
    return any("bert_layers." in str(v) for v in c.get("auto_map", {}).values())


def with_code(ref, model_dir, tmp):
    """A copy of model_dir (in tmp) with the reference code installed; model_dir itself when it
    is not a DNABERT-2 directory."""
    if not is_dnabert2(model_dir):
        return model_dir
    dest = os.path.join(tmp, "dnabert2_" + os.path.basename(os.path.abspath(model_dir)))
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(model_dir, dest)
    install(ref, dest)
    # "<repo>--module.Class" (an export without the code) would be fetched from the hub.
    import json
    path = os.path.join(dest, "config.json")
    with open(path) as f:
        c = json.load(f)
    c["auto_map"] = {k: v.split("--")[-1] for k, v in c["auto_map"].items()}
    with open(path, "w") as f:
        json.dump(c, f, indent=2)
    return dest

"""What the Python peers of tests/hf share: importing transformers & co. (or failing with what
to do), the Auto class for a model directory, DNABERT's k-mer input convention, and the
logit comparison."""
import json
import os
import sys

# The sequences every fixture and export check uses (one short, so padding matters).
SEQS = ["ACGTACGTTAGCCGATAGGCTTACGATCGATCGGATCCATGCAAGTCNNACGTTGCA",
        "TTGACAGCTAGCTCAGTCCTAGGTATAATGCTAGCACGTAGCTAGCAGTCAGTACGA",
        "GGGCGCATTACGAT"]


def require(*names):
    """Imports the named modules and returns them. A missing one is a failure, never a skip:
    CI installs them."""
    import importlib
    mods = []
    for name in names:
        try:
            mods.append(importlib.import_module(name))
        except ImportError as e:
            sys.exit(f"FAIL: {sys.executable} cannot import {name} ({e}). These tests check our "
                     "files with the real Python libraries: run scripts/install-deps.sh (it "
                     "installs requirements.txt into the project's virtual environment) and "
                     "configure the build with that python (scripts/build.sh does).")
    return mods


def import_peers(*extra):
    """Imports torch, transformers, peft, safetensors (and `extra`) or fails; returns (torch,
    transformers)."""
    torch, transformers = require("torch", "transformers", "peft", "safetensors", *extra)[:2]
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars in test logs
    return torch, transformers


def overlapping_kmers(seq, k):
    """DNABERT's input convention: every k-mer at stride 1, separated by spaces."""
    return " ".join(seq[i:i + k] for i in range(len(seq) - k + 1))


def auto_model_class(transformers, model_dir):
    """The Auto class for config.json's architecture (masked LM, causal LM or classifier)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    for suffix, cls in (("ForMaskedLM", transformers.AutoModelForMaskedLM),
                        ("ForCausalLM", transformers.AutoModelForCausalLM),
                        ("ForSequenceClassification",
                         transformers.AutoModelForSequenceClassification)):
        if arch.endswith(suffix):
            return cls
    raise SystemExit(f"FAIL: {model_dir}/config.json: unexpected architecture {arch}")


def max_abs_diff(a, b, mask=None):
    """max |a - b| in float64; with `mask` (batch x tokens), at the real tokens only."""
    a, b = a.double(), b.double().reshape(a.shape)
    if mask is not None:
        m = mask.bool()
        a, b = a[m], b[m]
    return (a - b).abs().max().item()


def load_model(cls, model_dir):
    """cls.from_pretrained(model_dir) in eval mode, and what transformers' loading report says
    is wrong with the file: "" when every tensor the model has was in the file and nothing
    else was (a missing one would be newly initialised, silently, apart from a log line)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        remote = "auto_map" in json.load(f)  # DNABERT-2: tests/hf/dnabert2_reference.py
    model, info = cls.from_pretrained(model_dir, output_loading_info=True,
                                      trust_remote_code=remote)
    problems = [f"{what} {sorted(map(str, info[what]))}"
                for what in ("missing_keys", "unexpected_keys", "mismatched_keys")
                if info.get(what)]
    return model.eval(), "; ".join(problems)


def adapter_problems(peft, peft_model, adapter_dir):
    """"" when adapter_model.safetensors holds exactly the tensors PEFT saves for this adapter
    (get_peft_model_state_dict): none missing (PEFT would keep its initial value), none extra."""
    from safetensors.torch import load_file
    saved = set(load_file(os.path.join(adapter_dir, "adapter_model.safetensors")))
    wanted = set(peft.get_peft_model_state_dict(peft_model))
    problems = []
    if wanted - saved:
        problems.append(f"missing {sorted(wanted - saved)}")
    if saved - wanted:
        problems.append(f"unexpected {sorted(saved - wanted)}")
    return "; ".join(problems)

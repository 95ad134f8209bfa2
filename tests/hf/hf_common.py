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


def checks_exit_code(failures, passed="all checks passed"):
    """Says how a script's checks went (`passed`, or how many failed) and returns its exit code:
    0 when `failures` is 0."""
    print(passed if failures == 0 else f"{failures} check(s) failed")
    return 1 if failures else 0


class Checks:
    """A check script's checks: report() prints one's line ("ok  " or "FAIL", what, detail) and
    counts those that failed; exit_code() ends with the verdict (checks_exit_code)."""

    def __init__(self):
        self.failures = 0

    def report(self, what, ok, detail):
        self.failures += 0 if ok else 1
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}", flush=True)

    def exit_code(self, passed="all checks passed"):
        return checks_exit_code(self.failures, passed)


def versions(*modules):
    """"name version" of each module, comma-separated: what a check ran against."""
    return ", ".join(f"{m.__name__} {m.__version__}" for m in modules)


def exports_exit_code(script, worst):
    """The exit code of a script that loads our exports with a reference's code: 0 when the
    largest |logit difference| against the fixtures, `worst`, is within 1e-4, else 1 after
    saying so."""
    if worst > 1e-4:
        print(f"{script}: FAILED (max difference {worst:.3g} > 1e-4)")
        return 1
    return 0


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
        # DNABERT-2 (tests/hf/dnabert2_reference.py) through an Auto class; a Nucleotide
        # Transformer v2 class (nt_v2_model_class) is its remote code already
        remote = "auto_map" in json.load(f) and cls.__name__.startswith("Auto")
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


# Nucleotide Transformer v2 / AgroNT ship their model as remote code (config.json's auto_map):
# esm_config.EsmConfig and modeling_esm.EsmFor{MaskedLM,SequenceClassification} of InstaDeepAI's
# Hugging Face repositories. CI cannot fetch them, so these families run only where a copy of the
# two files is given (--nt-v2-code DIR or $DNALLM_NT_V2_CODE); never committed here.
NT_V2_AUTO_MAP = {
    "AutoConfig": "esm_config.EsmConfig",
    "AutoModelForMaskedLM": "modeling_esm.EsmForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_esm.EsmForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_esm.EsmForTokenClassification",
}


def nt_v2_code_dir(arg=None):
    """The folder holding esm_config.py and modeling_esm.py (argument, else $DNALLM_NT_V2_CODE),
    or None."""
    path = arg or os.environ.get("DNALLM_NT_V2_CODE") or None
    if path and not all(os.path.isfile(os.path.join(path, f))
                        for f in ("esm_config.py", "modeling_esm.py")):
        sys.exit(f"FAIL: {path} lacks esm_config.py / modeling_esm.py (the Nucleotide "
                 "Transformer v2 remote code)")
    return path


def add_remote_code_arguments(ap, skipped):
    """--dnabert2-ref and --nt-v2-code: the folders of DNABERT-2's and of Nucleotide Transformer
    v2's remote code, which this repository does not hold; without DNABERT-2's, `skipped` are
    skipped. remote_code() reads them."""
    ap.add_argument("--dnabert2-ref", help="DNABERT-2's remote code (default "
                    f"$DNALLM_DNABERT2_REF); without it {skipped} are skipped")
    ap.add_argument("--nt-v2-code", help="folder with the Nucleotide Transformer v2 remote code "
                    "(default $DNALLM_NT_V2_CODE)")


def remote_code(args):
    """(DNABERT-2's reference folder, the Nucleotide Transformer v2 modeling module) of
    add_remote_code_arguments' options or their environment variables; None for either not
    given."""
    import dnabert2_reference
    ref = dnabert2_reference.reference_dir(args.dnabert2_ref)
    nt_v2_code = nt_v2_code_dir(args.nt_v2_code)
    return ref, import_nt_v2(nt_v2_code) if nt_v2_code else None


def import_nt_v2(path):
    """Imports the remote code from `path` as the package nt_v2_remote and returns the
    modeling_esm module. It was written for transformers 4.3x: what transformers 5 removed and
    it still calls is restored here, with the 4.x behaviour (no change to its computation)."""
    import importlib
    import types
    import torch
    import transformers.pytorch_utils as pytorch_utils
    if not hasattr(pytorch_utils, "find_pruneable_heads_and_indices"):
        def find_pruneable_heads_and_indices(heads, n_heads, head_size, already_pruned_heads):
            raise NotImplementedError("head pruning is not used by these tests")
        pytorch_utils.find_pruneable_heads_and_indices = find_pruneable_heads_and_indices
    if "nt_v2_remote" not in sys.modules:
        pkg = types.ModuleType("nt_v2_remote")
        pkg.__path__ = [os.path.abspath(path)]
        sys.modules["nt_v2_remote"] = pkg
    config = importlib.import_module("nt_v2_remote.esm_config")
    modeling = importlib.import_module("nt_v2_remote.modeling_esm")
    for key in ("is_decoder", "add_cross_attention"):  # 4.x PretrainedConfig defaults
        if not hasattr(config.EsmConfig, key):
            setattr(config.EsmConfig, key, False)
    base = modeling.EsmPreTrainedModel
    if not hasattr(base, "get_extended_attention_mask"):
        def get_extended_attention_mask(self, attention_mask, input_shape, device=None,
                                        dtype=None):
            dtype = dtype or self.dtype
            mask = attention_mask[:, None, None, :].to(dtype)
            return (1.0 - mask) * torch.finfo(dtype).min
        base.get_extended_attention_mask = get_extended_attention_mask
    if not hasattr(base, "get_head_mask"):
        def get_head_mask(self, head_mask, num_hidden_layers):
            assert head_mask is None, "head_mask is not used by these tests"
            return [None] * num_hidden_layers
        base.get_head_mask = get_head_mask
    for cls in (modeling.EsmForMaskedLM, modeling.EsmForSequenceClassification):
        if isinstance(getattr(cls, "_tied_weights_keys", None), list):
            cls._tied_weights_keys = {}  # 5.x wants a dict; the checkpoints store the decoder
    if not hasattr(base, "all_tied_weights_keys"):
        base.all_tied_weights_keys = {}  # 4.x init_weights() before 5.x post_init() set it
    return modeling


def nt_v2_model_class(modeling, model_dir):
    """The remote class config.json's architecture names."""
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    return getattr(modeling, arch)


def reference_package(package, folder):
    """Makes `folder` (a model's remote code: files that import each other relatively, e.g.
    modeling_hyena.py with `from .configuration_hyena import ...`) importable as `package`,
    without copying it anywhere. The code is the reference's, never ours."""
    import types
    pkg = types.ModuleType(package)
    pkg.__path__ = [os.path.abspath(folder)]
    sys.modules[package] = pkg
    return pkg


def import_reference(code, package):
    """import_peers() with transformers' logging at errors only, and the reference's model code
    in the folder `code` importable as `package` (reference_package): what the scripts that check
    our exports against, or make fixtures with, HyenaDNA's and Caduceus's hub code start with.
    Returns (torch, transformers)."""
    torch, transformers = import_peers()
    transformers.logging.set_verbosity_error()
    reference_package(package, code)
    return torch, transformers


class CodeFolders:
    """The folders of a reference's code that a script runs, which this repository does not hold
    (CI cannot fetch them): each of `folders`, (option, environment variable[, help]), becomes
    an option of `ap` whose default is the variable; once the arguments are parsed, missing()
    says what the script did not do without them."""

    def __init__(self, ap, *folders):
        self.options = [f[0] for f in folders]
        self.variables = [f[1] for f in folders]
        self.dests = [ap.add_argument(option, default=os.environ.get(variable, ""),
                                      help=text[0] if text else None).dest
                      for option, variable, *text in folders]

    def missing(self, script, args, not_done):
        """True, after printing "`script`: no --a/--b (VAR_A, VAR_B): `not_done`", when a folder
        was named neither by its option nor by its variable (the script then exits 0)."""
        if all(getattr(args, dest) for dest in self.dests):
            return False
        print(f"{script}: no {'/'.join(self.options)} ({', '.join(self.variables)}): {not_done}")
        return True


def add_time_steps_arguments(ap, seq, steps):
    """--seq and --batch (each step's input: batch x seq tokens), --steps and --warmup (what
    time_steps times), with `seq` and `steps` as this peer's defaults (the peers of bench/hyena
    and bench/caduceus)."""
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=1)


def time_steps(step, warmup, steps):
    """Seconds per call of `step` over `steps` calls after `warmup` untimed ones (the peers of
    bench/hyena and bench/caduceus)."""
    import time
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / max(steps, 1)

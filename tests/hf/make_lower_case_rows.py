#!/usr/bin/env python3
"""Golden lower-case rows for the character tokenizers whose code is not installed in CI:
tests/data/hf-fixtures/{hyenadna_causal,caduceus_ps_mlm}/lower_case.json, the input_ids the
reference tokenizer code gives for the soft-masked sequences tests/hf/check_lower_case.py builds
(its rows(): soft_masked() of the fixture's sequences and n_row()), as they are and
upper-cased, batch-padded as the reference pads. check_lower_case.py compares `dnallm-eval
--logits` with these rows.

The reference code is public but not ours: it is never committed. --code names a folder holding
  hg38_char_tokenizer.py   HyenaDNA's CharacterTokenizer (HazyResearch/hyena-dna,
                           src/dataloaders/datasets/hg38_char_tokenizer.py)
  tokenization_caduceus.py CaduceusTokenizer (kuleshov-group/caduceus,
                           caduceus/tokenization_caduceus.py, the file the hub repositories ship)
without it this script exits 0 with a message (CI cannot fetch them). --hyena-source and
--caduceus-source say where the files came from (repository@commit:path); the JSON records that,
each file's sha256 and the transformers version.

  python tests/hf/make_lower_case_rows.py --code /tmp/lower_ref --fixtures tests/data/hf-fixtures

HyenaDNA's CharacterTokenizer calls PreTrainedTokenizer.__init__ before it builds its vocabulary
and defines no get_vocab(), which transformers >= 4.34 asks for inside that __init__ (the hub
port, tokenization_hyena.py, builds the vocabulary first). TransformersCompat below runs the
reference's __init__ unchanged with the base initialiser deferred until the vocabulary exists;
the tokenization itself (_tokenize, _convert_token_to_id, build_inputs_with_special_tokens,
padding) is the reference's.
"""
import argparse
import hashlib
import json
import os
import sys

from check_lower_case import rows
from hf_common import CodeFolders, import_peers

HYENA_SOURCE = ("HazyResearch/hyena-dna@d553021b483b82980aa4b868b37ec2d4332e198a:"
                "src/dataloaders/datasets/hg38_char_tokenizer.py")
CADUCEUS_SOURCE = ("kuleshov-group/caduceus@0060a6d8079b6a040fc55d505e15972a327b70a6:"
                   "caduceus/tokenization_caduceus.py")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def dumps(doc):
    """JSON with one line a key, and one line a row of ids or a sequence."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, list):
            items = ",\n  ".join(json.dumps(v, separators=(",", ":")) for v in value)
            lines.append(f" {json.dumps(key)}: [\n  {items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def hyena_tokenizer(transformers, folder):
    """CharacterTokenizer as the fixture's tokenizer_config.json configures HyenaDNATokenizer
    (characters A C G T N, model_max_length, padding_side)."""
    from hg38_char_tokenizer import CharacterTokenizer

    class DeferredInit(transformers.PreTrainedTokenizer):
        """Stands between CharacterTokenizer and PreTrainedTokenizer in the MRO: the reference's
        super().__init__(...) lands here and is kept for after its vocabulary exists."""

        def __init__(self, **kwargs):
            self._deferred_init = kwargs

    class TransformersCompat(CharacterTokenizer, DeferredInit):
        def __init__(self, **kwargs):
            CharacterTokenizer.__init__(self, **kwargs)  # the reference's, up to its vocabulary
            transformers.PreTrainedTokenizer.__init__(self, **self.__dict__.pop("_deferred_init"))

        def get_vocab(self):
            return dict(self._vocab_str_to_int)

    config = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    assert config["tokenizer_class"] == "HyenaDNATokenizer", config["tokenizer_class"]
    args = dict(characters=list(config.get("characters") or "ACGTN"),
                model_max_length=config["model_max_length"],
                padding_side=config.get("padding_side", "left"))
    return TransformersCompat(**args), args


def caduceus_tokenizer(folder):
    """CaduceusTokenizer as the published Caduceus checkpoints configure it (their
    tokenizer_config.json: model_max_length 131072, padding_side left, characters A C G T N by
    default); the fixture folder has no tokenizer_config.json, so ours reads those defaults."""
    from tokenization_caduceus import CaduceusTokenizer
    path = os.path.join(folder, "tokenizer_config.json")
    config = json.load(open(path)) if os.path.exists(path) else {}
    args = dict(model_max_length=config.get("model_max_length", 131072),
                padding_side=config.get("padding_side", "left"))
    if config.get("characters"):
        args["characters"] = list(config["characters"])
    return CaduceusTokenizer(**args), args


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    code = CodeFolders(ap, ("--code", "DNALLM_LOWER_CASE_CODE",
                            "folder with hg38_char_tokenizer.py and tokenization_caduceus.py"))
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--hyena-source", default=HYENA_SOURCE)
    ap.add_argument("--caduceus-source", default=CADUCEUS_SOURCE)
    args = ap.parse_args()
    if code.missing("make_lower_case_rows", args, "lower-case rows not made"):
        return 0
    torch, transformers = import_peers()
    transformers.logging.set_verbosity_error()
    sys.path.insert(0, os.path.abspath(args.code))
    cases = [("hyenadna_causal", "hg38_char_tokenizer.py", args.hyena_source,
              lambda folder: hyena_tokenizer(transformers, folder)),
             ("caduceus_ps_mlm", "tokenization_caduceus.py", args.caduceus_source,
              caduceus_tokenizer)]
    for name, file, source, make in cases:
        folder = os.path.join(args.fixtures, name)
        tok, tok_args = make(folder)
        seqs = rows(json.load(open(os.path.join(folder, "fixture.json")))["sequences"])
        lower = tok(seqs, padding=True)["input_ids"]
        upper = tok([s.upper() for s in seqs], padding=True)["input_ids"]
        out = {"made_by": "tests/hf/make_lower_case_rows.py",
               "tokenizer": type(tok).__mro__[1].__name__ if name.startswith("hyena")
               else type(tok).__name__,
               "source": source, "source_sha256": sha256(os.path.join(args.code, file)),
               "transformers_version": transformers.__version__,
               "tokenizer_arguments": tok_args, "padding_side": tok.padding_side,
               "sequences": seqs, "input_ids": lower, "uppercase_input_ids": upper}
        path = os.path.join(folder, "lower_case.json")
        with open(path, "w") as f:
            f.write(dumps(out))
        print(f"{path}: {len(seqs)} rows of {len(lower[0])} tokens ({out['tokenizer']}, {source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

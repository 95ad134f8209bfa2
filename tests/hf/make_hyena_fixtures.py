#!/usr/bin/env python3
"""Golden fixtures for HyenaDNA (tests/data/hf-fixtures/hyenadna_*), made by the reference
code users load the published checkpoints with: LongSafari's hub files modeling_hyena.py,
configuration_hyena.py and tokenization_hyena.py (HazyResearch/hyena-dna's Hugging Face port).
That code is public but not ours: it is never committed. Point --code at a folder holding the
three files (e.g. copied from a clone of a hyenadna-*-seqlen-hf repository); without it this
script exits 0 with a message, since CI cannot fetch it.

  python tests/hf/make_hyena_fixtures.py --code /tmp/hyena_ref/hf --out tests/data/hf-fixtures

Each fixture: config.json (with the hub's auto_map), model.safetensors, tokenizer_config.json,
fixture.json (sequences, ids) and expected.safetensors (input_ids, logits fp32, computed by the
reference on the CPU). Every parameter is perturbed off its initial value. hyenadna_cls also has
its positional features z moved (as the reference trains them, learning rate 1e-5), so an
import that regenerates z instead of reading a trained one shows. hyenadna_long holds one
sequence of 4,100 bases (the FFT convolution past 4k tokens).
"""
import argparse
import gzip
import json
import os
import sys

from hf_common import SEQS, CodeFolders, import_reference

TINY = dict(vocab_size=12, d_model=32, d_inner=64, n_layer=2, emb_dim=5, filter_order=16,
            num_inner_mlps=2, activation_freq=10, pad_token_id=4, embed_dropout=0.0,
            layer_norm_epsilon=1e-5, use_bias=True, train_freq=True, tie_word_embeddings=False)
AUTO_MAP = {
    "AutoConfig": "configuration_hyena.HyenaConfig",
    "AutoModel": "modeling_hyena.HyenaDNAModel",
    "AutoModelForCausalLM": "modeling_hyena.HyenaDNAForCausalLM",
    "AutoModelForSequenceClassification": "modeling_hyena.HyenaDNAForSequenceClassification",
}


def genome_bases(n):
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "data", "ecoli_k12_mg1655.fa.gz")
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.startswith(">"):
                continue
            out.append(line.strip().upper())
            if sum(map(len, out)) >= n + 20000:
                break
    return "".join(out)[20000:20000 + n]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    code = CodeFolders(ap, ("--code", "DNALLM_HYENA_CODE",
                            "folder with modeling_hyena.py, configuration_hyena.py, "
                            "tokenization_hyena.py"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if code.missing("make_hyena_fixtures", args, "HyenaDNA fixtures not made"):
        return 0
    torch, transformers = import_reference(args.code, "hyena_ref")
    from hyena_ref.configuration_hyena import HyenaConfig
    from hyena_ref.modeling_hyena import HyenaDNAForCausalLM, HyenaDNAForSequenceClassification
    from hyena_ref.tokenization_hyena import HyenaDNATokenizer
    from safetensors.torch import save_file, safe_open

    cases = [
        ("hyenadna_causal", HyenaDNAForCausalLM, dict(max_seq_len=130), SEQS, False),
        ("hyenadna_cls", HyenaDNAForSequenceClassification,
         dict(max_seq_len=130, num_labels=3), SEQS, True),
        ("hyenadna_long", HyenaDNAForCausalLM, dict(max_seq_len=4200), [genome_bases(4100)], False),
    ]
    for index, (name, cls, extra, seqs, move_z) in enumerate(cases):
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        torch.manual_seed(args.seed + index)
        config = HyenaConfig(**TINY, **extra)
        config.auto_map = AUTO_MAP
        config.architectures = [cls.__name__]
        model = cls(config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.add_(torch.randn_like(p) * 0.05)
            # z is a parameter in the original code (learning rate 1e-5) and a buffer in the
            # current hub code: either way a published file may hold a trained one.
            for bname, b in model.named_buffers():
                if move_z and bname.endswith("pos_emb.z"):
                    b.add_(torch.randn_like(b) * 1e-3)
        # The hub code shares one Sin module (one frequency) between the filter's layers, which
        # transformers >= 5 refuses to save ("shared tensors ... not properly defined"): written
        # as older transformers did, one name per shared tensor (safetensors' save_model).
        from safetensors.torch import save_model
        config.save_pretrained(folder)
        save_model(model, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        tok = HyenaDNATokenizer(model_max_length=config.max_seq_len)
        tok.save_pretrained(folder)
        enc = tok(seqs, padding=True, return_tensors="pt")
        ids = enc["input_ids"].contiguous()
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
            again = cls.from_pretrained(folder).eval()(input_ids=ids).logits.float()
        assert torch.equal(again, logits), f"{folder}: the saved model computes otherwise"
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            kept = [k for k in f.keys() if k.endswith(".freq")]
        save_file({"input_ids": ids, "logits": logits.contiguous()},
                  os.path.join(folder, "expected.safetensors"))
        with open(os.path.join(folder, "fixture.json"), "w") as f:
            json.dump({"family": name, "class": cls.__name__,
                       "tokenizer_class": "HyenaDNATokenizer", "sequences": seqs,
                       "input_ids": ids.tolist() if ids.numel() < 1000 else "expected.safetensors",
                       "logits_shape": list(logits.shape), "freq_names_kept": kept,
                       "made_by": "tests/hf/make_hyena_fixtures.py (LongSafari's hub code)"},
                      f, indent=1)
            f.write("\n")
        print(f"{name}: logits {list(logits.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Final hidden states of the golden fixtures (tests/data/hf-fixtures/*/hidden.safetensors), made
by each family's reference implementation: what the model body returns before its LM or
classification head, for the fixture's own batch (expected.safetensors' input_ids and
attention_mask, padding included). They are what an import's embeddings (per token, and
mean-pooled over them) must equal.

For every fixture folder with a config.json (bert_cls_lora, a PEFT adapter, has none at its top
and is left out) the script loads the model with its reference code, runs the whole model on the
fixture's batch with a forward hook on the body, checks that the logits equal
expected.safetensors' (max |diff| <= --tolerance, default 1e-5: the same model and code path as
the fixture) and writes `hidden_states` float32 [B, T, H], the body's output[0] in that very
call. With --check it compares with the hidden.safetensors already there instead of writing.

  body (what hidden_states is)                       families
  BertModel.last_hidden_state (last layer's output   bert_mlm, bert_cls (post-LN BERT: the last
    LayerNorm; no pooler)                              layer ends in its own LayerNorm)
  EsmModel.last_hidden_state (after                  esm_mlm, esm_cls, esm_v1_mlm
    encoder.emb_layer_norm_after)
  RobertaPreLayerNormModel (after its final          roberta_prelayernorm_mlm
    LayerNorm)
  GPTNeoXModel (after final_layer_norm)              gptneox_causal
  LlamaModel (after norm, RMSNorm)                   llama_causal, llama_gqa_causal, llama_mqa_causal
  DNABERT-2 bert_layers.BertModel outputs[0]         dnabert2_mlm, dnabert2_cls, dnabert2_long_mlm
    (post-LN: last layer's LayerNorm; padded back
    to [B, T, H], zeros at padding)
  NT v2 modeling_esm.EsmModel outputs[0] (after      esm_v2_mlm, esm_v2_cls
    encoder.emb_layer_norm_after)
  HyenaDNAModel outputs[0] (after backbone.ln_f)     hyenadna_causal, hyenadna_cls, hyenadna_long
  Caduceus outputs[0] (after backbone.norm_f; RCPS:  caduceus_ph_mlm, caduceus_ps_mlm,
    2*d_model channels, forward half then the          caduceus_ps_cls, caduceus_ps_fused_mlm
    reverse-complement half as the backbone returns
    them)

Reference code (none of it committed; each family is skipped with a message without it):
  --dnabert2-ref DIR   bert_layers.py, bert_padding.py, configuration_bert.py of DNABERT-2
                       (taken from github.com/MAGICS-LAB/DNABERT_S evaluate/model_codes/,
                       commit ac01b55e5034182e4b915d34ce5a3a323b82adb8; the sha256 in
                       dnabert2_mlm/fixture.json), run with tests/hf/dnabert2_reference.py's shims
  --nt-v2-code DIR     esm_config.py, modeling_esm.py of nucleotide-transformer-v2 (as vendored
                       in github.com/canallee/native-torch-autoporting-trainium,
                       nucleotide-transformer/native-pytorch/src/nucleotide_transformer_neuron/,
                       commit 1cbf869cfb973c81a11c77bba023949363e43838), with hf_common's helpers
  --hyena-code DIR     LongSafari's modeling_hyena.py, configuration_hyena.py (as
                       make_hyena_fixtures.py loads them; the tokenizer is not needed: the ids
                       are the fixture's). The committed files were made with the copy that the
                       hub checkpoint github.com/shubhamtkr/checkpoint-62500 ships (commit
                       18ec6529d286b28beccf5e674d287fe8491d0883)
  --caduceus-code DIR, --mamba DIR
                       as make_caduceus_fixtures.py: kuleshov-group/caduceus's caduceus/*.py
                       (commit 0060a6d8079b6a040fc55d505e15972a327b70a6, tie_weights patched to
                       take *args, **kwargs) and a CPU mamba_ssm (state-spaces/mamba commit
                       e9594ce1c732d97440f0332fdc43170a2294dbfa: modules/mamba_simple.py and
                       block.py unchanged, selective_scan_fn = selective_scan_ref, RMSNorm
                       computing rms_norm_ref)

The committed files were made with transformers 5.24.0, torch 2.14.1, einops 0.8.2, fp32 on the
CPU:

  python tests/hf/make_hidden_states.py tests/data/hf-fixtures --dnabert2-ref /tmp/ref/dnabert2 \\
      --nt-v2-code /tmp/ref/ntv2 --hyena-code /tmp/ref/hyena \\
      --caduceus-code /tmp/ref/caduceus --mamba /tmp/ref/mamba [--only FAMILY ...] [--check]
"""
import argparse
import json
import os
import sys
import tempfile

import dnabert2_reference
from hf_common import (auto_model_class, import_nt_v2, import_peers, load_model, max_abs_diff,
                       nt_v2_code_dir, nt_v2_model_class, reference_package)

# family kind -> (attribute of the body in the whole model, what its output is)
BODY = {
    "bert": ("bert", "BertModel last_hidden_state (last layer's output LayerNorm)"),
    "esm": ("esm", "EsmModel last_hidden_state (after encoder.emb_layer_norm_after)"),
    "roberta-prelayernorm": ("roberta_prelayernorm",
                             "RobertaPreLayerNormModel last_hidden_state (after its LayerNorm)"),
    "gpt_neox": ("gpt_neox", "GPTNeoXModel last_hidden_state (after final_layer_norm)"),
    "llama": ("model", "LlamaModel last_hidden_state (after norm, RMSNorm)"),
    "dnabert2": ("bert", "DNABERT-2 bert_layers.BertModel outputs[0] (last layer's output "
                         "LayerNorm, padded back to [B, T, H]: zeros at padding)"),
    "nt_v2": ("esm", "NT v2 modeling_esm.EsmModel outputs[0] (after "
                     "encoder.emb_layer_norm_after)"),
    "hyena": ("hyena", "HyenaDNAModel outputs[0] (after backbone.ln_f)"),
    "caduceus": ("caduceus", "Caduceus outputs[0] (after backbone.norm_f; RCPS: 2*d_model "
                             "channels as the backbone returns them)"),
}


def family_kind(folder, config):
    if dnabert2_reference.is_dnabert2(folder):
        return "dnabert2"
    auto_map = config.get("auto_map", {})
    if any("esm_config." in str(v) for v in auto_map.values()):
        return "nt_v2"
    kind = {"hyenadna": "hyena", "caduceus": "caduceus"}.get(config["model_type"],
                                                            config["model_type"])
    if kind not in BODY:
        sys.exit(f"FAIL: {folder}: model_type {config['model_type']} has no body here")
    return kind


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fixtures", help="the fixtures folder (tests/data/hf-fixtures)")
    ap.add_argument("--only", action="append", help="a family (repeatable); default: all")
    ap.add_argument("--tolerance", type=float, default=1e-5,
                    help="max |logits - expected| for the reference to count as the fixture's")
    ap.add_argument("--check", action="store_true",
                    help="compare with the hidden.safetensors there instead of writing")
    ap.add_argument("--dnabert2-ref")
    ap.add_argument("--nt-v2-code")
    ap.add_argument("--hyena-code", default=os.environ.get("DNALLM_HYENA_CODE", ""))
    ap.add_argument("--caduceus-code", default=os.environ.get("DNALLM_CADUCEUS_CODE", ""))
    ap.add_argument("--mamba", default=os.environ.get("DNALLM_MAMBA_CPU", ""))
    args = ap.parse_args()

    ref = dnabert2_reference.reference_dir(args.dnabert2_ref)
    if args.mamba:
        sys.path.insert(0, os.path.abspath(args.mamba))
    torch, transformers = import_peers()
    transformers.logging.set_verbosity_error()
    nt_v2_code = nt_v2_code_dir(args.nt_v2_code)
    nt_v2 = import_nt_v2(nt_v2_code) if nt_v2_code else None
    hyena = caduceus = None
    if args.hyena_code:
        reference_package("hyena_ref", args.hyena_code)
        import hyena_ref.modeling_hyena as hyena
    if args.caduceus_code and args.mamba:
        reference_package("caduceus_ref", args.caduceus_code)
        import caduceus_ref.configuration_caduceus as caduceus_config
        import caduceus_ref.modeling_caduceus as caduceus
        import caduceus_ref.modeling_rcps as caduceus_rcps
        import mamba_ssm.ops.triton.layer_norm as mamba_layer_norm
        from make_caduceus_fixtures import fused_norm_fn
        for module in (caduceus, caduceus_rcps):  # fused_add_norm (caduceus_ps_fused_mlm)
            module.layer_norm_fn = fused_norm_fn(mamba_layer_norm, False)
            module.rms_norm_fn = fused_norm_fn(mamba_layer_norm, True)
    from safetensors.torch import load_file, save_file
    from safetensors.torch import load_model as load_safetensors_model
    versions = (f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(versions)

    scratch = tempfile.TemporaryDirectory()
    failures = 0
    names = sorted(n for n in os.listdir(args.fixtures)
                   if os.path.isfile(os.path.join(args.fixtures, n, "config.json")))
    for family in args.only or names:
        folder = os.path.join(args.fixtures, family)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        kind = family_kind(folder, config)
        arch = config["architectures"][0]
        if kind == "dnabert2":
            if ref is None:
                print(f"skip {family}: {dnabert2_reference.SKIP_MESSAGE}")
                continue
            model, problems = load_model(auto_model_class(transformers, folder),
                                         dnabert2_reference.with_code(ref, folder, scratch.name))
        elif kind == "nt_v2":
            if nt_v2 is None:
                print(f"skip {family}: no Nucleotide Transformer v2 code (--nt-v2-code DIR)")
                continue
            model, problems = load_model(nt_v2_model_class(nt_v2, folder), folder)
        elif kind == "hyena":
            if hyena is None:
                print(f"skip {family}: no HyenaDNA reference code (--hyena-code DIR)")
                continue
            model, info = getattr(hyena, arch).from_pretrained(folder, output_loading_info=True)
            model = model.eval()
            problems = "; ".join(f"{k} {sorted(info[k])}" for k in
                                 ("missing_keys", "unexpected_keys", "mismatched_keys")
                                 if info.get(k))
        elif kind == "caduceus":
            if caduceus is None:
                print(f"skip {family}: no Caduceus reference code (--caduceus-code DIR "
                      "--mamba DIR)")
                continue
            # make_caduceus_fixtures.py built the model from its config and wrote it with
            # safetensors' save_model, which keeps one name per shared tensor (mamba_rev's tied
            # in/out projections, the RCPS head tied to the embedding); load_model is its
            # inverse (strict: every tensor the model has, shared ones through their kept name).
            model = getattr(caduceus, arch)(
                caduceus_config.CaduceusConfig.from_pretrained(folder)).eval()
            missing, unexpected = load_safetensors_model(
                model, os.path.join(folder, "model.safetensors"), strict=True)
            problems = "; ".join(f"{k} {sorted(v)}" for k, v in
                                 (("missing", missing), ("unexpected", unexpected)) if v)
        else:
            model, problems = load_model(auto_model_class(transformers, folder), folder)
        if problems:
            print(f"FAIL {family}: the weights do not load cleanly: {problems}")
            failures += 1
            continue
        attr, meaning = BODY[kind]
        body = getattr(model, attr)
        seen = []

        def hook(module, inputs, output):
            out = output if torch.is_tensor(output) else output[0]
            seen.append(out.detach().float().clone())

        handle = body.register_forward_hook(hook)
        expected = load_file(os.path.join(folder, "expected.safetensors"))
        feed = {"input_ids": expected["input_ids"]}
        if "attention_mask" in expected:
            feed["attention_mask"] = expected["attention_mask"]
        with torch.no_grad():
            logits = model(**feed).logits.float()
        handle.remove()
        assert len(seen) == 1, f"{family}: the body ran {len(seen)} times"
        hidden = seen[0].contiguous()
        diff = max_abs_diff(logits, expected["logits"])
        ids = expected["input_ids"]
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(ids.shape):
            print(f"FAIL {family}: body output {list(hidden.shape)} for ids {list(ids.shape)}")
            failures += 1
            continue
        if not diff <= args.tolerance:
            print(f"FAIL {family}: {type(model).__name__} logits differ from expected by {diff:.3g}"
                  f" (> {args.tolerance}): not the fixture's model or code path; not written")
            failures += 1
            continue
        path = os.path.join(folder, "hidden.safetensors")
        if args.check:
            if not os.path.isfile(path):
                print(f"FAIL {family}: no {path}")
                failures += 1
                continue
            old = load_file(path)["hidden_states"]
            hdiff = max_abs_diff(hidden, old)
            ok = old.shape == hidden.shape and hdiff <= args.tolerance
            failures += 0 if ok else 1
            print(f"{'ok  ' if ok else 'FAIL'} {family}: logits {diff:.3g}, hidden.safetensors "
                  f"{list(old.shape)} max |diff| {hdiff:.3g}")
            continue
        save_file({"hidden_states": hidden}, path,
                  metadata={"body": f"{type(model).__name__}.{attr}", "meaning": meaning,
                            "made_by": "tests/hf/make_hidden_states.py", "versions": versions,
                            "logits_max_abs_diff": f"{diff:.3g}"})
        print(f"ok   {family}: {type(model).__name__}.{attr} -> hidden_states "
              f"{list(hidden.shape)}; logits max |diff| {diff:.3g}")
    print("done" if failures == 0 else f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

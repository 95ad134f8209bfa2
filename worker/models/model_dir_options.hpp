// The command-line options that name a model directory for the one loader (Note [One model
// loader], model_dir.hpp), the same flags and help in every program that loads one
// (dnallm-eval, dnallm-infer).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace dnallm::models {

// --model (required), --uppercase and --base.
inline void add_model_dir_options(CLI::App& app, std::string& model_dir, std::string& base_dir,
                                  bool& uppercase) {
  app.add_option("--model", model_dir,
                 "model directory: dnallm-train's final/ or best/, a Hugging Face directory as "
                 "downloaded, or a PEFT adapter directory (docs/published-models.md)")
      ->required();
  app.add_flag("--uppercase", uppercase,
               "read lower-case (soft-masked) bases as bases; by default a Hugging Face model's "
               "tokenizer reads them as its reference does (unknown tokens)");
  app.add_option("--base", base_dir,
                 "a PEFT adapter's base directory, when its adapter_config.json does not name one");
}

}  // namespace dnallm::models

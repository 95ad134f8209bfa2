// Scores of a classifier from its confusion matrix (torch-free): what dnallm-eval prints and
// what the trainer's evaluation logs and selects the best checkpoint by.
//
// Note [Classification scores]: the definitions of scikit-learn, which the published DNA
// fine-tuning results use (DNABERT-2's GUE scripts: accuracy_score, f1_score(average="macro",
// zero_division=0), matthews_corrcoef, precision/recall macro):
//   accuracy   correct rows / rows
//   mcc        Gorodkin's K-class Matthews correlation; 0 when either marginal is constant
//   f1 (macro) the unweighted mean over the classes that occur in the truth or the
//              predictions of 2PR/(P+R) per class (0 where P + R = 0); precision and recall
//              the same means (a class never predicted has precision 0, never true recall 0)
#pragma once

#include <cstdint>
#include <vector>

namespace dnallm {

// confusion[truth][predicted], rows counted (doubles: sums of all-reduced counts).
using ConfusionMatrix = std::vector<std::vector<double>>;

struct ClassificationScores {
  double accuracy = 0.0;
  double mcc = 0.0;
  double f1 = 0.0;  // macro
  double precision = 0.0;
  double recall = 0.0;
  int64_t rows = 0;
};

// Note [Classification scores]. An empty matrix (no rows) gives all zeros.
ClassificationScores classification_scores(const ConfusionMatrix& confusion);

}  // namespace dnallm

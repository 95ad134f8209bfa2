// Note [Classification scores]: our scores against scikit-learn's on the same labels
// (expected values printed by scikit-learn 1.9.1: accuracy_score, matthews_corrcoef,
// f1_score / precision_score / recall_score with average="macro", zero_division=0).
#include "core/classification.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace dnallm {
namespace {

ConfusionMatrix confusion_of(const std::vector<int>& truth, const std::vector<int>& predicted,
                             int classes) {
  ConfusionMatrix m(classes, std::vector<double>(classes, 0.0));
  for (size_t i = 0; i < truth.size(); ++i) m[truth[i]][predicted[i]] += 1;
  return m;
}

struct Case {
  const char* name;
  std::vector<int> truth, predicted;
  int classes;
  double accuracy, mcc, f1, precision, recall;
};

TEST(ClassificationScores, MatchScikitLearn) {
  const std::vector<Case> cases = {
      {"binary",
       {0, 0, 0, 1, 1, 1, 1, 0, 1, 0},
       {0, 1, 0, 1, 1, 0, 1, 0, 1, 1},
       2,
       0.7,
       0.408248290463863,
       0.696969696969697,
       0.708333333333333,
       0.7},
      {"three",
       {0, 1, 2, 2, 1, 0, 2, 1, 0, 2, 2, 1},
       {0, 2, 2, 2, 1, 1, 0, 1, 0, 2, 1, 1},
       3,
       0.666666666666667,
       0.5,
       0.666666666666667,
       0.672222222222222,
       0.672222222222222},
      // Class 2 is true but never predicted: precision 0 for it, still averaged.
      {"never_predicted",
       {0, 1, 2, 0, 1, 2},
       {0, 1, 1, 0, 1, 1},
       3,
       0.666666666666667,
       0.612372435695795,
       0.555555555555555,
       0.5,
       0.666666666666667},
      // Class 2 is predicted but never true: recall 0 for it, still averaged.
      {"predicted_only",
       {0, 0, 1, 1},
       {0, 2, 1, 1},
       3,
       0.75,
       0.670820393249937,
       0.555555555555555,
       0.666666666666667,
       0.5},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto s = classification_scores(confusion_of(c.truth, c.predicted, c.classes));
    EXPECT_EQ(s.rows, static_cast<int64_t>(c.truth.size()));
    EXPECT_NEAR(s.accuracy, c.accuracy, 1e-12);
    EXPECT_NEAR(s.mcc, c.mcc, 1e-12);
    EXPECT_NEAR(s.f1, c.f1, 1e-12);
    EXPECT_NEAR(s.precision, c.precision, 1e-12);
    EXPECT_NEAR(s.recall, c.recall, 1e-12);
  }
}

TEST(ClassificationScores, ClassesAbsentFromBothSidesAreNotAveraged) {
  // 4 classes declared, labels only ever 0/1: the same scores as a 2-class matrix.
  const auto two = classification_scores(confusion_of({0, 1, 1, 0}, {0, 1, 0, 0}, 2));
  const auto four = classification_scores(confusion_of({0, 1, 1, 0}, {0, 1, 0, 0}, 4));
  EXPECT_DOUBLE_EQ(two.f1, four.f1);
  EXPECT_DOUBLE_EQ(two.mcc, four.mcc);
}

TEST(ClassificationScores, DegenerateInputs) {
  const auto none = classification_scores(ConfusionMatrix(2, std::vector<double>(2, 0.0)));
  EXPECT_EQ(none.rows, 0);
  EXPECT_EQ(none.mcc, 0.0);
  // One class predicted for every row: MCC is 0 (constant marginal), not NaN.
  const auto constant = classification_scores(confusion_of({0, 1, 1}, {1, 1, 1}, 2));
  EXPECT_EQ(constant.mcc, 0.0);
  EXPECT_NEAR(constant.accuracy, 2.0 / 3.0, 1e-12);
}

}  // namespace
}  // namespace dnallm

#include "core/classification.hpp"

#include <cmath>

namespace dnallm {

ClassificationScores classification_scores(const ConfusionMatrix& confusion) {
  const size_t k = confusion.size();
  std::vector<double> truth(k, 0.0), predicted(k, 0.0);
  double rows = 0.0, correct = 0.0;
  for (size_t i = 0; i < k; ++i) {
    for (size_t j = 0; j < k; ++j) {
      truth[i] += confusion[i][j];
      predicted[j] += confusion[i][j];
      rows += confusion[i][j];
    }
    correct += confusion[i][i];
  }
  ClassificationScores s;
  s.rows = static_cast<int64_t>(rows);
  if (rows <= 0) return s;
  s.accuracy = correct / rows;
  // Gorodkin: (c s - sum_k t_k p_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2)).
  double tp = 0.0, tt = 0.0, pp = 0.0;
  for (size_t i = 0; i < k; ++i) {
    tp += truth[i] * predicted[i];
    tt += truth[i] * truth[i];
    pp += predicted[i] * predicted[i];
  }
  const double den = std::sqrt(rows * rows - pp) * std::sqrt(rows * rows - tt);
  s.mcc = den > 0 ? (correct * rows - tp) / den : 0.0;
  double classes = 0.0;
  for (size_t i = 0; i < k; ++i) {
    if (truth[i] <= 0 && predicted[i] <= 0) continue;  // absent from both: not averaged
    classes += 1.0;
    const double precision = predicted[i] > 0 ? confusion[i][i] / predicted[i] : 0.0;
    const double recall = truth[i] > 0 ? confusion[i][i] / truth[i] : 0.0;
    s.precision += precision;
    s.recall += recall;
    s.f1 += precision + recall > 0 ? 2.0 * precision * recall / (precision + recall) : 0.0;
  }
  s.precision /= classes;
  s.recall /= classes;
  s.f1 /= classes;
  return s;
}

}  // namespace dnallm

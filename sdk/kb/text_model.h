// The learned text model: a linear classifier over hashed word and character
// n-grams of an incident's text (context and message), trained by
// scripts/train_text_model.py from the train split of the report corpus
// (tests/kb/testdata/corpus) and shipped as text_model_weights.inc.
//
// It reads the prose the evidence rules cannot weigh (how a person describes
// the failure, which library printed what); the classifier combines its
// probabilities with the rules' candidates and maps the result to a
// calibrated confidence (classifier.cc). The features are defined here and
// in the training script alike; the script's `features` self-check and
// text_model_test.cc pin them to each other.
//
// Thread-safety: pure functions over constant weights.
#ifndef OOMGUARD_SDK_KB_TEXT_MODEL_H_
#define OOMGUARD_SDK_KB_TEXT_MODEL_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace oomguard::kb {

struct TextModelInfo {
  int buckets = 0;                     // hashed feature space
  std::vector<std::string> classes;    // patterns, in weight order
  bool trained = false;                // false: no weights shipped (every probability equal)
  double combine_rule_weight = 0;      // how much a rule's confidence adds to a class's probability
  double strong_rule = 1.0;            // a rule candidate at or above this decides alone
  double decision_floor = 0.45;        // a calibrated confidence below it answers "unknown" (chosen on validation)
  double rule_confidence_cap = 1.0;    // the most a rule deciding a report alone claims (chosen on validation)
  std::vector<std::pair<double, double>> calibration;  // (margin, right share), ascending in margin
};

const TextModelInfo& TextModel();

// Sparse hashed features of `text` (bucket, value), L2-normalised. Exposed
// for the cross-check with the training script.
std::vector<std::pair<int, float>> TextFeatures(std::string_view text, int buckets);

// Class probabilities (softmax) for `text`, in TextModel().classes order.
std::vector<double> TextProbabilities(std::string_view text);

// The calibrated probability that an answer is right, from `score`: the
// margin of its combined score (text probability + rule weight x rule
// confidence) over the next class's (piecewise-linear over the calibration
// table; 0.8 or more only where validation showed 95% of answers right).
double CalibratedConfidence(double score);

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_TEXT_MODEL_H_

// Note [Model registry]: the table of model families (registry.hpp). A new family's one line
// outside its folder is its entry here. Nothing includes this file: the registry reads the
// table through model_families(), so that the families may include registry.hpp while the
// registry includes none of them.
#include "worker/models/caduceus/caduceus_model.hpp"
#include "worker/models/hyena/hyena_model.hpp"
#include "worker/models/registry.hpp"
#include "worker/models/transformer/transformer.hpp"

namespace dnallm::models {

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {transformer_family(), hyena::hyena_family(),
                                                    caduceus::caduceus_family()};
  return families;
}

}  // namespace dnallm::models

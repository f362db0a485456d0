// The model families colod shards out of the box (registered in
// ModelRegistry::Global()): each builds the Hugging Face model's module tree
// with its tensor names and forward semantics, and brings its policy. Their
// layers are declared once, in spec/plan.cc's layer tables; each builds its
// tree and derives its policy's replacements from its table
// (table_family.h).
//
//   gpt2   GPT2LMHeadModel: 1d (fused c_attn as Linear1D_Col with n_fused = 3,
//          vocab-parallel wte and tied head), sequence_parallel, 2d and 2.5d.
//   llama  LlamaForCausalLM: 1d (q/k/v, gate/up column-parallel, o/down
//          row-parallel, grouped-query heads split over tp, vocab-parallel
//          embedding and LM head), sequence_parallel, 2d and 2.5d.
//   bert   BertForMaskedLM: 1d (column-parallel q/k/v and intermediate,
//          row-parallel outputs, vocab-parallel word embeddings, tied decoder
//          and its bias) and 3d.
//   opt    OPTForCausalLM: 1d (q/k/v, fc1 column-parallel, out_proj, fc2
//          row-parallel, vocab-parallel embed_tokens and tied head;
//          project_in/out replicated), sequence_parallel, 2d and 2.5d;
//          pre- and post-norm layers, positions offset by 2.
//   bloom  BloomForCausalLM: 1d (fused per-head query_key_value and
//          dense_h_to_4h column-parallel, dense and dense_4h_to_h
//          row-parallel, vocab-parallel word_embeddings and tied head; each
//          rank's heads keep their ALiBi slopes), sequence_parallel.
//   vit    ViTForImageClassification: 1d (query/key/value and
//          intermediate.dense column-parallel, attention.output.dense and
//          output.dense row-parallel; patch embedding, CLS token, positions
//          and classifier replicated). Reads images, gives [B, 1, labels].
//   t5     T5ForConditionalGeneration: 1d (q/k/v and wi column-parallel,
//          o and wo row-parallel, heads split with each rank's columns of
//          layer 0's relative bias, vocab-parallel shared embedding and
//          head). Reads token ids and decoder ids.
#ifndef COLOD_WORKER_SHARDFORMER_MODELS_H_
#define COLOD_WORKER_SHARDFORMER_MODELS_H_

#include "worker/shardformer/shardformer.h"

namespace colod::shardformer {

ModelFamily Gpt2Family();
ModelFamily LlamaFamily();
ModelFamily BertFamily();
ModelFamily OptFamily();
ModelFamily BloomFamily();
ModelFamily VitFamily();
ModelFamily T5Family();

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_MODELS_H_

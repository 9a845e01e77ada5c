"""Makes tests/support/zoo_golden/: what MaxText's own to_huggingface code
makes of tiny random MaxText parameter trees, for tests/jax_sender/test_zoo.py
to hold jax_sender's MAXTEXT_* mappings against.

MaxText needs Python >= 3.12 and its whole training stack, so its conversion
functions are copied here unchanged (numpy and jax only), from the PyPI wheel
maxtext==0.2.5 (sha256 2fe8e4ffc3a06bd06f94daeaaf5fe3ecee748bb6f661c0f426e07e2ca10c9406),
which packages the GitHub repository AI-Hypercomputer/maxtext's src/maxtext:

- maxtext/checkpoint_conversion/utils/param_mapping.py
  (file sha256 e112f108abb56dbd21bf24eb6f26ff2c5c04f48315d02447c4a78f6de5c5b526):
  QWEN_MAXTEXT_TO_HF_PARAM_MAPPING, QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN (lines 596-855),
  LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING, LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN (2598-2753);
- maxtext/checkpoint_conversion/utils/hf_shape.py:
  QWEN_HF_WEIGHTS_TO_SHAPE, LLAMA31_HF_WEIGHTS_TO_SHAPE (lines 888-1043);
- maxtext/checkpoint_conversion/utils/utils.py
  (file sha256 1f68f9633ebb489a796d25bf5b4ace9ca20460d9c115b0020f7ce570f93eed8f):
  apply_hook_fns, convert_jax_weight_to_numpy, _process, and process_maxtext_param
  up to its case 2 (lines 142-318; its case 4, MoE expert stacking, is left out).

Those files are Copyright 2023-2026 Google LLC, Apache License 2.0. The same
functions are in the repository at src/maxtext/checkpoint_conversion/utils/
(an older commit, a429848a0a51b8c6c56c1d1e2f916b2f0e0a031e, names the Qwen ones
QWEN3_* and has no bias hooks; the Llama hooks are the same).

Run it from the repository root with numpy and jax installed:

    python tests/support/make_zoo_golden.py

It writes one .npz per case (Hugging Face name -> array; bfloat16 arrays stored
as their uint16 bits, named in the file's "__bfloat16__" entry). The trees
come from ``maxtext_tree`` below, which the test calls with the same seed.
"""
# ruff: noqa: E501, E741, F601, UP037  (the copied MaxText code, kept unchanged)

from __future__ import annotations

import os
import sys
import warnings
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

max_logging = SimpleNamespace(log=lambda *args, **kwargs: None)

# =============================================================================
# Copied from maxtext==0.2.5 (see the docstring), unchanged.
# =============================================================================

def QWEN_MAXTEXT_TO_HF_PARAM_MAPPING(config, maxtext_config, scan_layers=False):
  """Returns mapping from MaxText to HuggingFace Qwen weight paths.

  This function generates a dictionary that maps parameter names from a MaxText
  Qwen checkpoint to their corresponding names in the Hugging Face format.
  It handles both dense and Mixture-of-Experts (MoE) model variants.

  Args:
    config (dict): Model configuration dictionary, including
      'num_hidden_layers' and optionally 'num_experts'.
    scan_layers (bool, optional): Whether the MaxText model uses scanned
      layers. Defaults to False.

  Returns:
    dict: A mapping where keys are `atomic_mt_key` (single MaxText parameter names).
      Values are Hugging Face parameter names in one of four forms: unscanned (string),
      scanned (list of strings), unscanned with expert stacking (list of strings),
      or scanned with expert stacking (nested list of strings).
  """
  n_layers = config["num_hidden_layers"]
  num_experts = config.get("num_experts", config.get("num_local_experts", 0))

  mapping = {
      "params-token_embedder-embedding": "model.embed_tokens.weight",
      "params-decoder-decoder_norm-scale": "model.norm.weight",
      "params-decoder-logits_dense-kernel": "lm_head.weight",
  }

  if scan_layers:
    # This block handles scanned layers for both dense and MoE models.
    mapping.update(  # pyrefly: ignore[no-matching-overload]
        {
            "params-decoder-layers-pre_self_attention_layer_norm-scale": [
                f"model.layers.{i}.input_layernorm.weight" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-query-kernel": [
                f"model.layers.{i}.self_attn.q_proj.weight" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-key-kernel": [
                f"model.layers.{i}.self_attn.k_proj.weight" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-value-kernel": [
                f"model.layers.{i}.self_attn.v_proj.weight" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-query-bias": [
                f"model.layers.{i}.self_attn.q_proj.bias" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-key-bias": [
                f"model.layers.{i}.self_attn.k_proj.bias" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-value-bias": [
                f"model.layers.{i}.self_attn.v_proj.bias" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-out-kernel": [
                f"model.layers.{i}.self_attn.o_proj.weight" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-query_norm-scale": [
                f"model.layers.{i}.self_attn.q_norm.weight" for i in range(n_layers)
            ],
            "params-decoder-layers-self_attention-key_norm-scale": [
                f"model.layers.{i}.self_attn.k_norm.weight" for i in range(n_layers)
            ],
            "params-decoder-layers-post_self_attention_layer_norm-scale": [
                f"model.layers.{i}.post_attention_layernorm.weight" for i in range(n_layers)
            ],
        }
    )
    if num_experts > 1:
      # For scanned MoE, we create a nested list: [[e0_l0, e0_l1..], [e1_l0, e1_l1..]..]
      # This follows the (experts, layers, ...) tensor layout.
      mapping.update(  # pyrefly: ignore[no-matching-overload]
          {
              "params-decoder-layers-moe_block-gate-kernel": [
                  f"model.layers.{i}.mlp.gate.weight" for i in range(n_layers)
              ],
              "params-decoder-layers-moe_block-wi_0": [
                  [f"model.layers.{l}.mlp.experts.{e}.gate_proj.weight" for l in range(n_layers)]
                  for e in range(num_experts)
              ],
              "params-decoder-layers-moe_block-wi_1": [
                  [f"model.layers.{l}.mlp.experts.{e}.up_proj.weight" for l in range(n_layers)]
                  for e in range(num_experts)
              ],
              "params-decoder-layers-moe_block-wo": [
                  [f"model.layers.{l}.mlp.experts.{e}.down_proj.weight" for l in range(n_layers)]
                  for e in range(num_experts)
              ],
          }
      )
    else:  # Dense MLP
      mapping.update(  # pyrefly: ignore[no-matching-overload]
          {
              "params-decoder-layers-mlp-wi_0-kernel": [
                  f"model.layers.{i}.mlp.gate_proj.weight" for i in range(n_layers)
              ],
              "params-decoder-layers-mlp-wi_1-kernel": [f"model.layers.{i}.mlp.up_proj.weight" for i in range(n_layers)],
              "params-decoder-layers-mlp-wo-kernel": [f"model.layers.{i}.mlp.down_proj.weight" for i in range(n_layers)],
          }
      )
  else:  # unscanned layers
    for i in range(n_layers):
      # Common Attention and Norms
      # pylint: disable=line-too-long
      mapping.update(
          {
              f"params-decoder-layers_{i}-pre_self_attention_layer_norm-scale": f"model.layers.{i}.input_layernorm.weight",
              f"params-decoder-layers_{i}-self_attention-query-kernel": f"model.layers.{i}.self_attn.q_proj.weight",
              f"params-decoder-layers_{i}-self_attention-key-kernel": f"model.layers.{i}.self_attn.k_proj.weight",
              f"params-decoder-layers_{i}-self_attention-value-kernel": f"model.layers.{i}.self_attn.v_proj.weight",
              f"params-decoder-layers_{i}-self_attention-out-kernel": f"model.layers.{i}.self_attn.o_proj.weight",
              f"params-decoder-layers_{i}-self_attention-query-bias": f"model.layers.{i}.self_attn.q_proj.bias",
              f"params-decoder-layers_{i}-self_attention-key-bias": f"model.layers.{i}.self_attn.k_proj.bias",
              f"params-decoder-layers_{i}-self_attention-value-bias": f"model.layers.{i}.self_attn.v_proj.bias",
              f"params-decoder-layers_{i}-self_attention-query_norm-scale": f"model.layers.{i}.self_attn.q_norm.weight",
              f"params-decoder-layers_{i}-self_attention-key_norm-scale": f"model.layers.{i}.self_attn.k_norm.weight",
              f"params-decoder-layers_{i}-post_self_attention_layer_norm-scale": f"model.layers.{i}.post_attention_layernorm.weight",
              f"params-decoder-layers_{i}-post_self_attention_layer_norm-scale": f"model.layers.{i}.post_attention_layernorm.weight",
          }
      )
      if num_experts > 1:
        # For each unscanned MoE layer, map the MaxText parameter to a 1D list of all expert weights for that layer.
        mapping.update(  # pyrefly: ignore[no-matching-overload]
            {
                f"params-decoder-layers_{i}-moe_block-gate-kernel": f"model.layers.{i}.mlp.gate.weight",
                f"params-decoder-layers_{i}-moe_block-wi_0": [
                    f"model.layers.{i}.mlp.experts.{j}.gate_proj.weight" for j in range(num_experts)
                ],
                f"params-decoder-layers_{i}-moe_block-wi_1": [
                    f"model.layers.{i}.mlp.experts.{j}.up_proj.weight" for j in range(num_experts)
                ],
                f"params-decoder-layers_{i}-moe_block-wo": [
                    f"model.layers.{i}.mlp.experts.{j}.down_proj.weight" for j in range(num_experts)
                ],
            }
        )
      else:  # Dense MLP
        mapping.update(
            {
                f"params-decoder-layers_{i}-mlp-wi_0-kernel": f"model.layers.{i}.mlp.gate_proj.weight",
                f"params-decoder-layers_{i}-mlp-wi_1-kernel": f"model.layers.{i}.mlp.up_proj.weight",
                f"params-decoder-layers_{i}-mlp-wo-kernel": f"model.layers.{i}.mlp.down_proj.weight",
            }
        )
  return mapping


def QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN(config, maxtext_config, scan_layers=False, saving_to_hf=False):
  """Creates parameter transformation functions for Qwen.

  This function provides a dictionary of transformation functions (hooks) for
  converting Qwen model parameters between MaxText and Hugging Face formats.
  It handles embedding padding and kernel reshaping.

  Args:
    config (dict): Model configuration dictionary, including
      'num_hidden_layers' and optionally 'num_experts'.
    scan_layers (bool, optional): Whether the model uses scanned layers.
      Defaults to False.
    saving_to_hf (bool, optional): The direction of conversion. True for
      MaxText to Hugging Face, False for the reverse. Defaults to False.

  Returns:
    dict: A dictionary mapping MaxText parameter names to their corresponding
      transformation functions.
  """
  n_layers = config["num_hidden_layers"]
  num_experts = config.get("num_experts", config.get("num_local_experts", 0))

  def pad_embedding_layer(input_tensor, target_shape):
    """Pads or truncates embedding layer to match target vocab size."""
    source_vocab_size = input_tensor.shape[0]
    target_vocab_size = target_shape[0]

    if source_vocab_size == target_vocab_size:
      return input_tensor

    if saving_to_hf:  # MaxText to HF, truncate
      return input_tensor[:target_vocab_size, :]
    else:  # HF to MaxText, pad
      padded_tensor = np.zeros(target_shape, dtype=input_tensor.dtype)
      padded_tensor[:source_vocab_size, :] = input_tensor
      return padded_tensor

  def reshape_kernel(input_tensor, target_shape):
    """Reshapes and transposes kernel weights between MaxText and HF."""
    if saving_to_hf:
      flipped_target_shape = np.flip(np.array(target_shape))
      return input_tensor.reshape(flipped_target_shape).T
    else:
      return input_tensor.T.reshape(target_shape)

  def reshape_expert_kernel(input_tensor, target_shape=None):
    """Transposes expert weights.

    3D: (num_experts, in_dim, out_dim) -> (num_experts, out_dim, in_dim)
    2D: (in_dim, out_dim) -> (out_dim, in_dim)
    """
    if input_tensor.ndim == 3:
      return input_tensor.transpose(0, 2, 1)
    return input_tensor.transpose(1, 0)

  def reshape_bias(input_tensor, target_shape=None):
    """Reshapes biases between MaxText 2D (heads, dim) and HF 1D (hidden)."""
    # saving_to_hf: MaxText [heads, head_dim] -> HF [hidden_dim] (flatten)
    # loading_to_maxtext: HF [hidden_dim] -> MaxText [heads, head_dim]
    return input_tensor.reshape(target_shape)

  mapping = {
      "params-token_embedder-embedding": pad_embedding_layer,
      "params-decoder-logits_dense-kernel": reshape_kernel,
  }

  kernel_hooks = [
      "self_attention-query-kernel",
      "self_attention-key-kernel",
      "self_attention-value-kernel",
      "self_attention-out-kernel",
      "mlp-wi_0-kernel",
      "mlp-wi_1-kernel",
      "mlp-wo-kernel",
  ]
  bias_hooks = [
      "self_attention-query-bias",
      "self_attention-key-bias",
      "self_attention-value-bias",
  ]
  moe_gate_hooks = [
      "moe_block-gate-kernel",
      "moe_block-wi_0-kernel",
      "moe_block-wi_1-kernel",
      "moe_block-wo-kernel",
  ]
  moe_expert_hooks = [
      "moe_block-wi_0",
      "moe_block-wi_1",
      "moe_block-wo",
  ]

  if scan_layers:
    for key in kernel_hooks:
      mapping[f"params-decoder-layers-{key}"] = reshape_kernel
    for key in bias_hooks:
      mapping[f"params-decoder-layers-{key}"] = reshape_bias
    if num_experts > 1:
      for key in moe_gate_hooks:
        mapping[f"params-decoder-layers-{key}"] = reshape_kernel
      for key in moe_expert_hooks:
        mapping[f"params-decoder-layers-{key}"] = reshape_expert_kernel
  else:
    for i in range(n_layers):
      for key in kernel_hooks:
        mapping[f"params-decoder-layers_{i}-{key}"] = reshape_kernel
      for key in bias_hooks:
        mapping[f"params-decoder-layers_{i}-{key}"] = reshape_bias
      if num_experts > 1:
        for key in moe_gate_hooks:
          mapping[f"params-decoder-layers_{i}-{key}"] = reshape_kernel
        for key in moe_expert_hooks:
          mapping[f"params-decoder-layers_{i}-{key}"] = reshape_expert_kernel
  return mapping


def LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING(config, maxtext_config, scan_layers=False):
  """
  Returns a dictionary mapping from MaxText parameter names to
  HuggingFace LLaMA3.1 parameter names.

  Args:
      config (dict): Model configuration dictionary containing:
          - num_hidden_layers (int): The number of decoder layers.
      scan_layers (bool, optional): If True, MaxText layers are 'stacked'
          into a single param. Defaults to False.

  Returns:
      dict: A mapping where keys are `atomic_mt_key` (single MaxText parameter names).
        Values are either a single string (unscanned form) or a list of strings
        (scanned form) for stacked layers when `scan_layers=True`.
  """
  n_layers = config["num_hidden_layers"]

  mapping = {
      "params-token_embedder-embedding": "model.embed_tokens.weight",
      "params-decoder-logits_dense-kernel": "lm_head.weight",
      "params-decoder-decoder_norm-scale": "model.norm.weight",
  }

  if scan_layers:
    mapping["params-decoder-layers-self_attention-query-kernel"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.self_attn.q_proj.weight" for layer_idx in range(n_layers)
    ]
    mapping["params-decoder-layers-self_attention-key-kernel"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.self_attn.k_proj.weight" for layer_idx in range(n_layers)
    ]
    mapping["params-decoder-layers-self_attention-value-kernel"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.self_attn.v_proj.weight" for layer_idx in range(n_layers)
    ]
    mapping["params-decoder-layers-self_attention-out-kernel"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.self_attn.o_proj.weight" for layer_idx in range(n_layers)
    ]
    mapping["params-decoder-layers-mlp-wi_0-kernel"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.mlp.gate_proj.weight" for layer_idx in range(n_layers)
    ]
    mapping["params-decoder-layers-mlp-wi_1-kernel"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.mlp.up_proj.weight" for layer_idx in range(n_layers)
    ]
    mapping["params-decoder-layers-mlp-wo-kernel"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.mlp.down_proj.weight" for layer_idx in range(n_layers)
    ]
    mapping["params-decoder-layers-pre_self_attention_layer_norm-scale"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.input_layernorm.weight" for layer_idx in range(n_layers)
    ]
    mapping["params-decoder-layers-post_self_attention_layer_norm-scale"] = [  # pyrefly: ignore[bad-assignment]
        f"model.layers.{layer_idx}.post_attention_layernorm.weight" for layer_idx in range(n_layers)
    ]
  else:
    for layer_idx in range(n_layers):
      mapping[f"params-decoder-layers_{layer_idx}-self_attention-query-kernel"] = (
          f"model.layers.{layer_idx}.self_attn.q_proj.weight"
      )
      mapping[f"params-decoder-layers_{layer_idx}-self_attention-key-kernel"] = (
          f"model.layers.{layer_idx}.self_attn.k_proj.weight"
      )
      mapping[f"params-decoder-layers_{layer_idx}-self_attention-value-kernel"] = (
          f"model.layers.{layer_idx}.self_attn.v_proj.weight"
      )
      mapping[f"params-decoder-layers_{layer_idx}-self_attention-out-kernel"] = (
          f"model.layers.{layer_idx}.self_attn.o_proj.weight"
      )
      mapping[f"params-decoder-layers_{layer_idx}-mlp-wi_0-kernel"] = f"model.layers.{layer_idx}.mlp.gate_proj.weight"
      mapping[f"params-decoder-layers_{layer_idx}-mlp-wi_1-kernel"] = f"model.layers.{layer_idx}.mlp.up_proj.weight"
      mapping[f"params-decoder-layers_{layer_idx}-mlp-wo-kernel"] = f"model.layers.{layer_idx}.mlp.down_proj.weight"
      mapping[f"params-decoder-layers_{layer_idx}-pre_self_attention_layer_norm-scale"] = (
          f"model.layers.{layer_idx}.input_layernorm.weight"
      )
      mapping[f"params-decoder-layers_{layer_idx}-post_self_attention_layer_norm-scale"] = (
          f"model.layers.{layer_idx}.post_attention_layernorm.weight"
      )

  return mapping


def LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN(config, maxtext_config, scan_layers=False, saving_to_hf=False):
  """Creates parameter transformation functions for converting between MaxText and
  HuggingFace formats.

  This function generates a mapping of transformation functions that handle the necessary
  conversions between MaxText and HuggingFace parameter formats, including operations like
  reshaping.
  """
  nlayers = config["num_hidden_layers"]

  def scale_query_layer(input_tensor, target_shape):
    if saving_to_hf:
      depth_scale = np.dtype("float32").type(np.sqrt(config["head_dim"]))
      original_dtype = input_tensor.dtype
      output_tensor = input_tensor.astype(np.float32) * depth_scale
      return output_tensor.astype(original_dtype)
    else:
      depth_scale = np.dtype("float32").type(1 / np.sqrt(config["head_dim"]))
      original_dtype = input_tensor.dtype
      output_tensor = input_tensor.astype(np.float32) * depth_scale
      return output_tensor.astype(original_dtype)

  def adjust_rope(input_tensor, target_shape):
    arr = input_tensor
    if saving_to_hf:
      # Convert from MaxText's interleaved layout to HF's concatenated layout
      evens = arr[..., ::2]
      odds = arr[..., 1::2]
      return jax.numpy.concatenate((evens, odds), axis=arr.ndim - 1)
    else:
      # Convert from HF's concatenated layout to MaxText's interleaved layout
      half_dim = arr.shape[-1] // 2
      first_half = arr[..., :half_dim]
      second_half = arr[..., half_dim:]
      return jax.numpy.stack([first_half, second_half], axis=-1).reshape(arr.shape)

  def reshape_kernel(input_tensor, target_shape):
    if saving_to_hf:
      flipped_target_shape = np.flip(np.array(target_shape))
      return input_tensor.reshape(flipped_target_shape).transpose()
    else:
      return input_tensor.transpose().reshape(target_shape)

  # caveat: hook order does affect result
  # to_huggingface
  query_hook_chain = [scale_query_layer, adjust_rope, reshape_kernel]
  key_hook_chain = [adjust_rope, reshape_kernel]
  # to_maxtext
  if not saving_to_hf:
    query_hook_chain.reverse()
    key_hook_chain.reverse()

  hook_fns = {}

  hook_fns["params-decoder-logits_dense-kernel"] = reshape_kernel

  if scan_layers:
    hook_fns = {
        **hook_fns,
        "params-decoder-layers-self_attention-query-kernel": query_hook_chain,
        "params-decoder-layers-self_attention-key-kernel": key_hook_chain,
        "params-decoder-layers-self_attention-value-kernel": reshape_kernel,
        "params-decoder-layers-self_attention-out-kernel": reshape_kernel,
        "params-decoder-layers-mlp-wi_0-kernel": reshape_kernel,
        "params-decoder-layers-mlp-wi_1-kernel": reshape_kernel,
        "params-decoder-layers-mlp-wo-kernel": reshape_kernel,
    }
  else:
    for layer_idx in range(nlayers):
      hook_fns[f"params-decoder-layers_{layer_idx}-self_attention-query-kernel"] = query_hook_chain
      hook_fns[f"params-decoder-layers_{layer_idx}-self_attention-key-kernel"] = key_hook_chain
      hook_fns[f"params-decoder-layers_{layer_idx}-self_attention-value-kernel"] = reshape_kernel
      hook_fns[f"params-decoder-layers_{layer_idx}-self_attention-out-kernel"] = reshape_kernel
      hook_fns[f"params-decoder-layers_{layer_idx}-mlp-wi_0-kernel"] = reshape_kernel
      hook_fns[f"params-decoder-layers_{layer_idx}-mlp-wi_1-kernel"] = reshape_kernel
      hook_fns[f"params-decoder-layers_{layer_idx}-mlp-wo-kernel"] = reshape_kernel
  return hook_fns


def QWEN_HF_WEIGHTS_TO_SHAPE(config):
  """Returns mapping between HuggingFace Qwen weights path and the HuggingFace weights shape.

  Args:
      config (dict): HF configuration dictionary (from Qwen3TextConfig.to_dict())
          e.g., https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json

  Returns:
      dict: A mapping where:
          - Keys are HuggingFace model parameter paths
          - Values are parameter shape as a list

  To check expected mapping:
    from transformers import AutoModelForCausalLM
    model_name = "Qwen/Qwen3-0.6B"
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype="auto")
    for name, val in model.named_parameters():
      print(name, val.shape)
  """
  hidden_size = config["hidden_size"]
  num_hidden_layers = config["num_hidden_layers"]
  num_attention_heads = config["num_attention_heads"]
  num_key_value_heads = config["num_key_value_heads"]
  head_dim = config.get(
      "head_dim", config["hidden_size"] // config["num_attention_heads"]
  )  # head_dim might not always be present
  attention_bias = config.get("attention_bias", False)

  mapping = {
      "model.embed_tokens.weight": [config["vocab_size"], hidden_size],
      "model.norm.weight": [hidden_size],
      "lm_head.weight": [config["vocab_size"], hidden_size],
  }

  # Determine if the model is MoE based on config keys
  num_experts = config.get("num_experts", config.get("num_local_experts", 0))

  for layer_idx in range(num_hidden_layers):
    layer_prefix = f"model.layers.{layer_idx}"
    layer_mapping = {
        f"{layer_prefix}.input_layernorm.weight": [hidden_size],
        f"{layer_prefix}.post_attention_layernorm.weight": [hidden_size],
        # Attention projections
        f"{layer_prefix}.self_attn.q_proj.weight": [num_attention_heads * head_dim, hidden_size],
        f"{layer_prefix}.self_attn.k_proj.weight": [num_key_value_heads * head_dim, hidden_size],
        f"{layer_prefix}.self_attn.v_proj.weight": [num_key_value_heads * head_dim, hidden_size],
        f"{layer_prefix}.self_attn.o_proj.weight": [hidden_size, num_attention_heads * head_dim],
        # QK Norm weights (applied per head to the head_dim dimension)
        f"{layer_prefix}.self_attn.q_norm.weight": [head_dim],
        f"{layer_prefix}.self_attn.k_norm.weight": [head_dim],
    }

    if attention_bias:
      layer_mapping.update(
          {
              f"{layer_prefix}.self_attn.q_proj.bias": [num_attention_heads * head_dim],
              f"{layer_prefix}.self_attn.k_proj.bias": [num_key_value_heads * head_dim],
              f"{layer_prefix}.self_attn.v_proj.bias": [num_key_value_heads * head_dim],
          }
      )

    if num_experts > 1:
      # MoE MLP layers
      moe_ffn_intermediate_size = config.get("moe_intermediate_size")
      if moe_ffn_intermediate_size is None:
        # moe_intermediate_size refers to the intermediate size of the routed expert
        # For Qwen MoE, moe_intermediate_size is distinct from intermediate_size (for dense layers)
        # Fall back to intermediate_size
        moe_ffn_intermediate_size = config.get("intermediate_size")
        if moe_ffn_intermediate_size is None:
          raise ValueError(
              "MoE model detected (num_experts > 1) but 'moe_intermediate_size' or 'intermediate_size' not found in config."
          )

      layer_mapping.update(
          {
              f"{layer_prefix}.mlp.gate.weight": [num_experts, hidden_size],
          }
      )
      for expert_j in range(num_experts):
        expert_prefix = f"{layer_prefix}.mlp.experts.{expert_j}"
        layer_mapping.update(
            {
                f"{expert_prefix}.gate_proj.weight": [moe_ffn_intermediate_size, hidden_size],
                f"{expert_prefix}.up_proj.weight": [moe_ffn_intermediate_size, hidden_size],
                f"{expert_prefix}.down_proj.weight": [hidden_size, moe_ffn_intermediate_size],
            }
        )
    else:
      # Dense MLP layers
      dense_ffn_intermediate_size = config.get("intermediate_size")
      if dense_ffn_intermediate_size is None:
        raise ValueError("'intermediate_size' not found in config for a dense MLP.")
      layer_mapping.update(
          {
              f"{layer_prefix}.mlp.gate_proj.weight": [dense_ffn_intermediate_size, hidden_size],
              f"{layer_prefix}.mlp.up_proj.weight": [dense_ffn_intermediate_size, hidden_size],
              f"{layer_prefix}.mlp.down_proj.weight": [hidden_size, dense_ffn_intermediate_size],
          }
      )
    mapping.update(layer_mapping)
  return mapping


def LLAMA31_HF_WEIGHTS_TO_SHAPE(config):
  """Returns mapping between HuggingFace weights path and weights shape.

  Args:
      config (dict): Model configuration dictionary, defined in `model_configs.py`

  Returns:
      dict: A mapping where:
          - Keys are HuggingFace model parameter paths
          - Values are parameter shape as a List
  """

  mapping = {
      "model.embed_tokens.weight": [config["vocab_size"], config["hidden_size"]],
      "model.norm.weight": [config["hidden_size"]],
      "lm_head.weight": [config["vocab_size"], config["hidden_size"]],
  }
  for layer_idx in range(config["num_hidden_layers"]):
    layer_mapping = {
        f"model.layers.{layer_idx}.input_layernorm.weight": [config["hidden_size"]],
        f"model.layers.{layer_idx}.mlp.down_proj.weight": [
            config["hidden_size"],
            config["intermediate_size"],
        ],
        f"model.layers.{layer_idx}.mlp.up_proj.weight": [
            config["intermediate_size"],
            config["hidden_size"],
        ],
        f"model.layers.{layer_idx}.mlp.gate_proj.weight": [
            config["intermediate_size"],
            config["hidden_size"],
        ],
        f"model.layers.{layer_idx}.post_attention_layernorm.weight": [config["hidden_size"]],
        f"model.layers.{layer_idx}.self_attn.k_proj.weight": [
            config["num_key_value_heads"] * config["head_dim"],
            config["hidden_size"],
        ],
        f"model.layers.{layer_idx}.self_attn.o_proj.weight": [
            config["hidden_size"],
            config["num_attention_heads"] * config["head_dim"],
        ],
        f"model.layers.{layer_idx}.self_attn.q_proj.weight": [
            config["num_attention_heads"] * config["head_dim"],
            config["hidden_size"],
        ],
        f"model.layers.{layer_idx}.self_attn.v_proj.weight": [
            config["num_key_value_heads"] * config["head_dim"],
            config["hidden_size"],
        ],
    }
    mapping = {**mapping, **layer_mapping}
  return mapping


def apply_hook_fns(weight, target_shape, hook_fns):
  """Apply hook functions, essential for to_maxtext and to_huggingface"""
  # If hook is unsepecified, use identity
  if hook_fns is None:
    return weight
  if not isinstance(hook_fns, list):
    hook_fns = [hook_fns]
  # Apply a list of hooks, be careful of order
  for hook_fn in hook_fns:
    weight = hook_fn(weight, target_shape)
  return weight


def convert_jax_weight_to_numpy(weight: "jax.Array", dtype_str: None | str = None) -> np.ndarray:
  """Converts a JAX array to a NumPy array with the specified dtype, used in to_huggingface.

  Args:
    weight: The input JAX array, potentially sharded across devices.
    dtype_str: The target NumPy dtype as a string (e.g., 'float32', 'bfloat16').
      If None, the dtype of the input JAX array is preserved. Defaults to None.

  Returns:
    A NumPy array containing the data from `weight`, cast to `dtype_str` if provided.
  """
  final_dtype_str = str(weight.dtype) if dtype_str is None else dtype_str
  expected_shape = weight.shape

  if str(weight.dtype) != final_dtype_str:
    # Cast in JAX before process_allgather to reduce interconnect data transfer and host RAM
    # usage when downcasting dtypes.
    weight = weight.astype(final_dtype_str)

  weight = multihost_utils.process_allgather(weight)
  # Use np.asarray to avoid redundant copies when the gathered buffer can be viewed directly.
  np_array = np.asarray(weight)
  return np_array.reshape(expected_shape)


def _process(hf_path, processed_slice, output_weights, current_hook_fns, hf_shape_map, save_dtype):
  """Applies hooks, converts a JAX slice to NumPy, and appends it to the output list, used in to_huggingface"""
  # --- Case 1: 1-to-N Splitting (hf_path is a tuple) ---
  if isinstance(hf_path, tuple):
    # Perform safety check on the collective tuple key first
    if hf_path not in hf_shape_map:
      raise ValueError(f"HF path tuple '{hf_path}' not found in hf_shape_map.")
    target_hf_shapes = hf_shape_map[hf_path]

    # Apply hooks (your hook function returns a tuple of sliced JAX arrays)
    if current_hook_fns:
      processed_slice = apply_hook_fns(processed_slice, target_hf_shapes, current_hook_fns)

    # Iterate, unpack, and convert each component independently
    for path, single_slice, shape in zip(hf_path, processed_slice, target_hf_shapes):
      numpy_slice = convert_jax_weight_to_numpy(single_slice, save_dtype).reshape(shape)
      output_weights.append((path, numpy_slice))

  # --- Case 2: Legacy Standard 1-to-1 Mapping (hf_path is a single string) ---
  else:
    if hf_path not in hf_shape_map:
      raise ValueError(f"HF path '{hf_path}' not found in hf_shape_map.")
    target_hf_shape = hf_shape_map[hf_path]

    if current_hook_fns:
      processed_slice = apply_hook_fns(processed_slice, target_hf_shape, current_hook_fns)
    numpy_slice = convert_jax_weight_to_numpy(processed_slice, save_dtype).reshape(target_hf_shape)
    output_weights.append((hf_path, numpy_slice))


def process_maxtext_param(
    maxtext_param_key: str | tuple[str, ...],
    maxtext_param_weight: jax.Array | list[jax.Array],
    param_map: dict[str, Any],
    hook_fn_map: dict[str, Any],
    hf_shape_map: dict[str, Any],
    maxtext_config: Any,
) -> list[tuple[str, np.ndarray]]:
  """Processes a single MaxText parameter (or a group of parameters) for conversion, used in to_huggingface.

  This function is responsible for taking a MaxText parameter and transforming
  it into one or more Hugging Face compatible parameters. It handles various
  scenarios based on:
  - the MaxText key form (`atomic_mt_key` or `composite_mt_key`)
  - the Hugging Face value form (unscanned string, scanned list of strings,
    unscanned with expert stacking, or scanned with expert stacking).

  Args:
    maxtext_param_key: The key identifying the MaxText parameter(s). Can be
      an `atomic_mt_key` (str) or a `composite_mt_key` (tuple of str) mapping
      to HF parameter(s).
    maxtext_param_weight: The actual weight(s) of the MaxText parameter(s).
      This can be a single `jax.Array` for an `atomic_mt_key` or a list of
      `jax.Array` for a `composite_mt_key`.
    param_map: A dictionary mapping MaxText parameter keys to their corresponding
      Hugging Face target path(s).
    hook_fn_map: A dictionary mapping MaxText parameter keys to transformation
      functions (hooks) that should be applied to the weights.
    hf_shape_map: A dictionary mapping Hugging Face parameter paths to their
      expected shapes.
    maxtext_config: The MaxText configuration object, used to determine
      details like `param_scan_axis` and `base_num_decoder_layers`.

  Returns:
    A list of tuples, where each tuple contains:
    - hf_path (str): The Hugging Face parameter path.
    - hf_weight (np.ndarray): The transformed Hugging Face compatible weight.
  """
  max_logging.log(f"maxtext param: {maxtext_param_key}")

  if maxtext_param_key not in param_map:
    raise ValueError(f"MaxText param key '{maxtext_param_key}' not found in param_map.")
  hf_target_paths = param_map[maxtext_param_key]
  if hf_target_paths is None:
    max_logging.log(f"\tskipping parameter mapped to None: {maxtext_param_key}")
    return []
  if not hf_target_paths:
    raise ValueError(f"No HF target paths found for MaxText key '{maxtext_param_key}'")

  # If maxtext_param_key is not in hook_fn_map, current_hook_fns is None, indicating identity (no transformation)
  current_hook_fns = hook_fn_map.get(maxtext_param_key)

  # This list will store tuples of (hf_path, hf_weight)
  output_weights = []

  # Case 1: Unscanned
  if not isinstance(hf_target_paths, list):
    max_logging.log("\tunscan")
    hf_path = hf_target_paths
    _process(
        hf_path,
        maxtext_param_weight,
        output_weights,
        current_hook_fns,
        hf_shape_map,
        save_dtype=maxtext_config.weight_dtype,
    )
    return output_weights

  # Stacked MaxText weight
  # This handles the 3 remaining cases:
  # 2. Standard scanned layers (1D list of targets from a tensor stacked only on the layer axis)
  # 3. Unscanned MoE layers (1D list of targets from a tensor stacked only on the expert axis)
  # 4. Scanned MoE layers (2D list of targets from a tensor stacked on expert and layer axes)

  if not isinstance(hf_target_paths[0], list):
    # Case 2 or 3: The source tensor is stacked on a single axis.
    if maxtext_config.scan_layers:
      max_logging.log("\tscan")
      # Case 2: Standard scanned layer. Stacked on layer axis (param_scan_axis) for multidimensional
      # weights or 2D block scales, or axis 0 for 1D tensors (e.g. per-layer scalar scales like
      # Llama 3.1 FP8 `kernel_scale` with shape (num_layers,)).
      weight_sample = maxtext_param_weight[0] if isinstance(maxtext_param_weight, list) else maxtext_param_weight
      axis_to_slice = (
          maxtext_config.param_scan_axis if getattr(weight_sample, "ndim", 0) > maxtext_config.param_scan_axis else 0
      )
    else:
      max_logging.log("\tunscan moe")
      # Case 3: Unscanned MoE layer. Stacked ONLY on the expert axis. Assuming expert is axis 0.
      axis_to_slice = 0

    # Iterate through the slices of the MaxText weight along the determined stacking axis.
    for i, hf_path in enumerate(hf_target_paths):
      if isinstance(maxtext_param_weight, list):
        # Handles `composite_mt_key` mappings where weight is a list of tensors.
        weight_slice = [jax.lax.index_in_dim(x, i, axis=axis_to_slice, keepdims=False) for x in maxtext_param_weight]
      else:
        # Handles `atomic_mt_key` mappings by slicing the single tensor.
        weight_slice = jax.lax.index_in_dim(maxtext_param_weight, i, axis=axis_to_slice, keepdims=False)
      _process(
          hf_path,
          weight_slice,
          output_weights,
          current_hook_fns,
          hf_shape_map,
          save_dtype=maxtext_config.weight_dtype,
      )

    return output_weights
  # Case 4 (multi-axis stacking: scanned MoE) is not copied: these trees are dense.
  raise NotImplementedError("MoE expert stacking is not part of this copy")


# =============================================================================
# The tiny models and the driver (this project's code).
# =============================================================================

# heads * head_dim (4 * 8 = 32) != embed (12), so a swapped reshape cannot pass;
# 3 layers, so the layer axis differs from every other.
DIMS = dict(embed=12, heads=4, kv_heads=2, head_dim=8, ffn=20, vocab=32, layers=3)
SEED = 20250611

# case name -> (family, scanned, attention biases, q/k norms, dtype)
CASES = {
    "llama31_unscanned": ("llama31", False, False, False, "float32"),
    "llama31_scanned": ("llama31", True, False, False, "float32"),
    "llama31_scanned_bf16": ("llama31", True, False, False, "bfloat16"),
    "qwen3_unscanned": ("qwen3", False, False, True, "float32"),
    "qwen3_scanned": ("qwen3", True, False, True, "float32"),
    "qwen25_unscanned": ("qwen3", False, True, False, "float32"),
    "qwen25_scanned": ("qwen3", True, True, False, "float32"),
}


def _layer_shapes(bias: bool, qk_norm: bool) -> dict[tuple[str, ...], tuple[int, ...]]:
    d = DIMS
    e, n, k, h, f = d["embed"], d["heads"], d["kv_heads"], d["head_dim"], d["ffn"]
    shapes = {
        ("pre_self_attention_layer_norm", "scale"): (e,),
        ("post_self_attention_layer_norm", "scale"): (e,),
        ("self_attention", "query", "kernel"): (e, n, h),
        ("self_attention", "key", "kernel"): (e, k, h),
        ("self_attention", "value", "kernel"): (e, k, h),
        ("self_attention", "out", "kernel"): (n, h, e),
        ("mlp", "wi_0", "kernel"): (e, f),
        ("mlp", "wi_1", "kernel"): (e, f),
        ("mlp", "wo", "kernel"): (f, e),
    }
    if bias:
        shapes[("self_attention", "query", "bias")] = (n, h)
        shapes[("self_attention", "key", "bias")] = (k, h)
        shapes[("self_attention", "value", "bias")] = (k, h)
    if qk_norm:
        shapes[("self_attention", "query_norm", "scale")] = (h,)
        shapes[("self_attention", "key_norm", "scale")] = (h,)
    return shapes


def maxtext_tree(case: str, seed: int = SEED) -> dict:
    """The MaxText parameter tree (``state.params``: a top ``params`` key) of
    ``case``, random from ``seed``: layers stacked on axis 1 when scanned."""
    _, scanned, bias, qk_norm, dtype = CASES[case]
    d = DIMS
    leaves: dict[tuple[str, ...], tuple[int, ...]] = {
        ("token_embedder", "embedding"): (d["vocab"], d["embed"]),
        ("decoder", "decoder_norm", "scale"): (d["embed"],),
        ("decoder", "logits_dense", "kernel"): (d["embed"], d["vocab"]),
    }
    for sub, shape in _layer_shapes(bias, qk_norm).items():
        if scanned:
            leaves[("decoder", "layers", *sub)] = (shape[0], d["layers"], *shape[1:])
        else:
            for i in range(d["layers"]):
                leaves[("decoder", f"layers_{i}", *sub)] = shape
    rng = np.random.default_rng(seed)
    tree: dict = {}
    for path in sorted(leaves):
        arr = rng.standard_normal(leaves[path]).astype(np.float32)
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(arr, dtype=dtype)
    return {"params": tree}


def hf_config(case: str) -> dict:
    d = DIMS
    _, _, bias, _, _ = CASES[case]
    return {"num_hidden_layers": d["layers"], "hidden_size": d["embed"],
            "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"],
            "head_dim": d["head_dim"], "intermediate_size": d["ffn"],
            "vocab_size": d["vocab"], "attention_bias": bias}


def _flat(tree: dict, prefix: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, (*prefix, key)))
        else:
            out["-".join((*prefix, key))] = value  # MaxText's "params-decoder-..." keys
    return out


def maxtext_to_hf(case: str) -> dict[str, np.ndarray]:
    """What MaxText's to_huggingface makes of ``maxtext_tree(case)``
    (its _transform_weights_to_full_model loop, without LoRA)."""
    family, scanned, _, _, _ = CASES[case]
    config = hf_config(case)
    maxtext_config = SimpleNamespace(scan_layers=scanned, param_scan_axis=1, weight_dtype=None)
    if family == "llama31":
        param_map = LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING(config, maxtext_config, scanned)
        hook_map = LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN(config, maxtext_config, scanned, saving_to_hf=True)
        shape_map = LLAMA31_HF_WEIGHTS_TO_SHAPE(config)
    else:
        param_map = QWEN_MAXTEXT_TO_HF_PARAM_MAPPING(config, maxtext_config, scanned)
        hook_map = QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN(config, maxtext_config, scanned, saving_to_hf=True)
        shape_map = QWEN_HF_WEIGHTS_TO_SHAPE(config)
    state = _flat(maxtext_tree(case))
    unmapped = sorted(set(state) - set(param_map))
    if unmapped:
        raise ValueError(f"{case}: leaves MaxText has no name for: {unmapped}")
    out: dict[str, np.ndarray] = {}
    for key in param_map:
        weight = state.pop(key, None)
        if weight is not None:
            out.update(process_maxtext_param(key, weight, param_map, hook_map, shape_map, maxtext_config))
    return out


def save(case: str, arrays: dict[str, np.ndarray], folder: str) -> str:
    bf16 = sorted(k for k, v in arrays.items() if v.dtype == jnp.bfloat16)
    stored = {k: (v.view(np.uint16) if k in bf16 else v) for k, v in arrays.items()}
    stored["__bfloat16__"] = np.array(bf16, dtype=str)
    path = os.path.join(folder, f"{case}.npz")
    np.savez(path, **stored)
    return path


def load(path: str) -> dict[str, np.ndarray]:
    """A golden file back as name -> array (bfloat16 where it was)."""
    with np.load(path) as f:
        bf16 = set(f["__bfloat16__"].tolist())
        return {k: (f[k].view(jnp.bfloat16) if k in bf16 else f[k])
                for k in f.files if k != "__bfloat16__"}


def main() -> None:
    jax.config.update("jax_platforms", "cpu")
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo_golden")
    os.makedirs(folder, exist_ok=True)
    for case in CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            arrays = maxtext_to_hf(case)
        print(save(case, arrays, folder), len(arrays), "tensors", file=sys.stderr)


if __name__ == "__main__":
    main()

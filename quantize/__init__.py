"""polyspec.quantize: group-128 4-bit intermediate models with GPTQModel (issue: quantize/). Not implemented yet."""

"""polyspec.data: ShareGPT loading, chat-template tokenisation with loss masks, evaluation prompt sets.

- :mod:`polyspec.data.sharegpt`: ``load_conversations(source)`` -> normalised conversations + ``LoadReport``
- :mod:`polyspec.data.chat`: ``tokenize_conversation(tokenizer, messages, max_length)`` -> input_ids + loss_mask
- :mod:`polyspec.data.prepare`: ``prepare_dataset(data, tokenizer, workdir=..., tokenizer_id=...)`` -> cached Arrow splits
- :mod:`polyspec.data.prompts`: ``load_question_jsonl``, ``mtbench_questions``, ``humaneval_questions``

Nothing is imported here; import the submodule you need.
"""

"""polyspec.data: ShareGPT loading, chat-template tokenisation with loss masks, evaluation prompt sets."""

"""The built-in models: the GPT (dense and mixture-of-experts), an MLP, Hugging Face's causal LMs
with their plans, and weight initialisation. Each is a factory named by `_target_` in its YAML like
any user's model; what every model declares and how any is built and called is the contract
(training/contract/), which nothing here is needed for.
"""

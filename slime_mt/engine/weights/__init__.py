"""New weights to the engines: the transports (``sync``: in-process, safetensors folders, a broadcast
over the weight group, tensors by handle), the process group from trainer rank 0 to the engines'
devices (``group``), SGLang's named-tensor payload (``tensor_payload``), the weight-group backend inside
vLLM's workers (``vllm_worker``), safetensors folders checked from their headers (``checkpoint``), and
block-wise FP8 weights in the Hugging Face format for engines that serve an FP8 copy (``fp8``)."""

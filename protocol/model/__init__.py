"""What both ends share that is not the wire: reading the GGUF model file, the tokenizer and chat
template, sampling and the finish rule, the refinement policy, the device model's file names."""

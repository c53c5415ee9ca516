"""The OpenAI-compatible API: its protocol and how the platform serves it.

- `protocol`: request bodies (strict, vLLM's extensions) and their engine SamplingParams;
  `structured`: the output constraints they may ask for.
- `responses`: the typed answers: whole (`Completion`, `ChatCompletion`), streamed chunks,
  usage, logprobs, tool calls, model cards.
- `completions`, `chat`: a request from its body to its answer, whole or streamed; each
  stream's state is an object; `streaming`: what both share (running to the end, the SSE
  events and their billing), `sse`: the metered event stream, `prompt_batch`: a list of
  prompts as one request.
- `tool_calls`, `tool_stream`: tools in the prompt, calls out of the text, whole or streamed;
  `logprobs`: the logprobs shapes clients read; `bodies`: JSON bodies must be text.

The routes are platform/api/routes/inference.py.
"""

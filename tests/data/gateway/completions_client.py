"""A harness that renders its own prompts (ChatML, by hand) and calls the legacy
`/v1/completions` with the official `openai` SDK, reaching its session by API key on the
gateway's plain `/v1` path; it runs the first tool call of a reply via $AGENTRL_EXEC_URL."""

import json
import os
import re
import urllib.request

from openai import OpenAI

base = os.environ["OPENAI_BASE_URL"].split("/sessions/")[0] + "/v1"
client = OpenAI(base_url=base, api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
model = client.models.list().data[0].id
prompt = f"<|im_start|>user\n{os.environ['AGENTRL_TASK']}<|im_end|>\n<|im_start|>assistant\n"
for _ in range(3):
    text = client.completions.create(model=model, prompt=prompt, max_tokens=96).choices[0].text
    call = re.search(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    if call is None:
        break
    command = json.loads(call.group(1))["arguments"]["command"]
    request = urllib.request.Request(
        os.environ["AGENTRL_EXEC_URL"],
        json.dumps({"command": command}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        output = json.load(answer)["output"]
    prompt += f"{text}<|im_end|>\n<|im_start|>user\n{output}<|im_end|>\n<|im_start|>assistant\n"
print(f"completions harness done ({model})")

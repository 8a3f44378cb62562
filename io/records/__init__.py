"""The input side of a run: records as read, and how each becomes an engine request or an error row.

- readers/: RawRecords from JSONL, JSON arrays, Parquet, CSV and datasets; the input's fingerprint; locations
- request_builder: RequestBuilder, a RawRecord -> BuiltRequest or ErrorRow
- pooling_builder: PoolingRequestBuilder, a RawRecord -> BuiltPooling (embed, classify, score, rerank, reward)
- build_options: BuildOptions, the run's settings for building requests
- batch_lines: OpenAI batch lines (custom_id, url, body, model names)
- request_options: what a record's own fields may set (sampling, seed, n, priority, truncation)
- structured_output: the run's and a record's grammar (JSON schema, regex, choice)
- prompts: the prompt as token ids (raw, chat, --chat-field, --prompt-template, chat template, system prompt)
- prompt_template: --prompt-template's {field} placeholders
- seeds: a record's and a sample's seed from the run seed
- reject: Reject, what the building steps raise for a record that cannot be used
- pending: the records of a run still without a row (resume, shards, --limit)

io/records imports neither io/state nor io/rows (they may import it).
"""

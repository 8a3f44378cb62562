"""conveyor's input and output: records in, rows out, and the run directory that makes a run exactly-once.

The run itself (this folder):
    run_spec.py        RunSpec: everything a run is asked to do (the options dataclasses); drift derived from it
    run.py             Run: the local run, from its run directory to its output file
    records_run.py     the one loop: records -> request builder -> engine -> sink
    run_checks.py      the checks a run makes before any model work (output path, chat template)
    run_report.py      Outcome, RunResult and RunSummary: the typed report the CLI renders
    run_progress.py    RunProgress: a running run's counts, rate and ETA
    split_run.py       a run split into shards: a shard's finish, the Ray driver's run directory, the merge
    validate_run.py    `conveyor validate`'s run: no run directory, no engine
    validation.py      `conveyor validate`'s sink
    errors.py          the errors of a run as a whole (input, spec, output)
records/: the input side (imports neither state/ nor rows/)
    readers/           a file, stdin or a dataset as RawRecords, bad ones as errors; the input's fingerprint
    request_builder.py RequestBuilder: a RawRecord -> a BuiltRequest or an ErrorRow
    pooling_builder.py PoolingRequestBuilder: a RawRecord -> a pooling task's request or an ErrorRow
    build_options.py   BuildOptions: which fields hold what, the run seed, n, templates
    batch_lines.py     OpenAI batch lines (custom_id, url, body, model)
    request_options.py what a record's own fields may set (sampling, seed, n, priority, truncation)
    prompts.py         a record's prompt as tokens: raw, chat messages, --chat-field, --prompt-template
    prompt_template.py --prompt-template's {field} placeholders
    structured_output.py the run's and a record's grammar
    seeds.py           a record's and a sample's seeds
    reject.py          Reject: a record that cannot be used
    pending.py         the records that still need a row, on a resume
state/: the run directory
    run_dir.py         lock, manifest, drift
    journal.py         the committed rows: exactly once, resumable
    run_info.py        run.json: the record total and the command line
    shards.py          --shard I/N and the merge of the shards' rows
    status.py          what `conveyor status` shows
    atomic.py          files that appear whole or not at all
    paths.py           where a run writes, checked against what it reads
rows/: the output side
    rows.py            the output row: columns, types, ok and error rows
    sink.py            where records become rows: the in-flight join, totals, commits
    sink_options.py    ON_ERROR and CommitPolicy: the choices and defaults the options take
    writers.py         Parquet, JSONL and OpenAI-batch writers, in input order
    openai_lines.py    the pooling tasks' OpenAI / vLLM batch result lines
    figures.py         latency percentiles in bounded memory
"""

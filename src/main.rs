//! `megac`: the command-line interface (see `megac --help` and DESIGN.md's command line
//! contract). Each subcommand lives in `commands/`; errors are rendered once, here.

mod commands;
mod render;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A compiler and runtime for distributed LLM training.
#[derive(Parser)]
#[command(name = "megac", version, about, long_about = None)]
#[command(
    after_help = "Examples:\n  megac check examples/llama-tiny.toml\n  megac dump examples/gpt-tiny.toml --set parallel.tp=2\n  megac passes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Options shared by every command that reads a model.toml.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// Path to the model description (see docs/model-toml.md).
    #[arg(value_name = "MODEL.toml")]
    pub model: PathBuf,
    /// Override a model.toml key, e.g. `--set parallel.tp=2` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

/// How `--data` and `--eval-data` files are read (`megac run|train|eval`).
#[derive(clap::Args, Clone, Debug)]
pub struct DataReadArgs {
    /// A Hugging Face tokenizer.json for .txt and .jsonl data (documents separated by its EOS
    /// token); its vocabulary must fit model.vocab.
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: Option<PathBuf>,
    /// The tokenizer's end-of-document token (its text or id), when neither a
    /// tokenizer_config.json beside it nor a special token's name tells it.
    #[arg(long, value_name = "TOKEN", requires = "tokenizer")]
    pub eos: Option<String>,
    /// Megatron data: the train,valid,test split of each dataset's documents, as Megatron's
    /// --split (training reads the first part, evaluation the second).
    #[arg(long, default_value = "969,30,1", value_name = "TRAIN,VALID,TEST")]
    pub split: String,
}

impl DataReadArgs {
    /// The runtime's data options.
    pub fn options(&self) -> megac_runtime::data::DataOptions {
        megac_runtime::data::DataOptions {
            tokenizer: self.tokenizer.clone(),
            eos: self.eos.clone(),
            split: self.split.clone(),
            ..Default::default()
        }
    }
}

/// Options of `megac run` and `megac train`.
#[derive(clap::Args)]
pub struct RunArgs {
    /// Communicator: `local` (threads in this process), `mpi`, or `nccl` (with `--device
    /// cuda` under `megac launch`: MPI starts the ranks, NCCL carries the collectives).
    #[arg(long, default_value = "local", value_name = "local|mpi|nccl")]
    pub comm: String,
    /// Backend: `cpu`, or `cuda` (one-rank plans on GPU 0; docs/cuda.md says what it runs).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda")]
    pub device: String,
    /// Optimizer steps to run (default: train.steps of the model).
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Training data: `synthetic`, a `.bin` file of little-endian u32 token ids, a `.txt` file
    /// (byte-level tokens, or paragraphs with --tokenizer), a `.jsonl` file (a "text" field per
    /// line, with --tokenizer), a Megatron dataset PREFIX (PREFIX.bin + PREFIX.idx) or a blend
    /// "0.3 PREFIX_A 0.7 PREFIX_B"; see docs/data.md.
    #[arg(
        long,
        default_value = "synthetic",
        value_name = "synthetic|FILE|PREFIX|BLEND"
    )]
    pub data: String,
    /// How data files are read (tokenizer, EOS, Megatron split).
    #[command(flatten)]
    pub reading: DataReadArgs,
    /// Initial weights from Hugging Face safetensors (save_pretrained layout): a file, a
    /// sharded checkpoint's model.safetensors.index.json, or the folder holding either.
    #[arg(long, value_name = "FILE.safetensors|INDEX.json|DIR")]
    pub init: Option<PathBuf>,
    /// Write the trained weights as Hugging Face safetensors (not written when the run fails,
    /// e.g. on a non-finite loss). Every output path is checked before any work; missing
    /// folders are created.
    #[arg(long, value_name = "FILE.safetensors")]
    pub save_params: Option<PathBuf>,
    /// Write per-step losses, grad norms, learning rates and timings as JSON (only when the run
    /// succeeds).
    #[arg(long, value_name = "FILE.json")]
    pub report: Option<PathBuf>,
    /// Time every kernel after the first step and print a table by op (matmul share, GFLOP/s).
    #[arg(long)]
    pub profile: bool,
    /// Record every rank's pipeline actions, collectives, sends and receives, data loading
    /// and optimizer steps into DIR/rank-N.json (one file per rank, for `megac scan DIR`;
    /// DIR is created).
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,
    /// Write distributed checkpoints into DIR (DIR/step-NNNNNN/: one file per rank and an
    /// index; DIR/latest names the last complete one) after the last step and every
    /// --save-interval steps; see docs/checkpoints.md.
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Checkpoint every N steps (steps N, 2N, ...) as well as after the last.
    #[arg(long, value_name = "N", requires = "save")]
    pub save_interval: Option<u64>,
    /// Overlap checkpoint writes with training: each rank copies its shards to host memory
    /// and a background thread writes them; the checkpoint completes (index, DIR/latest) at
    /// the next save. The last step's checkpoint is written synchronously.
    #[arg(long, requires = "save")]
    pub save_async: bool,
    /// Resume from a checkpoint: DIR (its latest complete step) or DIR/step-NNNNNN, saved in
    /// any layout of the same model (with the same global batch and sequence length). --steps
    /// stays the total: a checkpoint of step 3 with --steps 6 trains steps 4, 5 and 6.
    #[arg(long, value_name = "DIR", conflicts_with = "init")]
    pub load: Option<PathBuf>,
    /// With --trace: also time every kernel and write rank 0's Chrome-trace timeline of them,
    /// DIR/rank-0.trace.json (opens in Perfetto; costs more than the event records).
    #[arg(long, requires = "trace")]
    pub trace_kernels: bool,
    /// Inject a timing fault (repeatable; numbers never change): slow-rank:R:F (rank R's
    /// compute F times slower), slow-link:A-B:F (transfers between ranks A and B F times
    /// slower), jitter:S[:SEED] (each compute segment slowed by 1 + S·|z|, z seeded normal),
    /// clock:R:MS:PPM (rank R's recorded clock MS ms ahead, PPM ppm fast; for `megac scan`).
    #[arg(long = "inject", value_name = "SPEC")]
    pub inject: Vec<String>,
    /// Perturb the run (repeatable; any layout): POINT:KIND or POINT:KIND@STEP, as `megac
    /// scope --perturb` (noise(SIGMA), scale(X), bitflip(sign|exponent|mantissa, RATE),
    /// zero-head(HEAD)); an activation point in every micro-batch (or step STEP's), a
    /// `weights.NAME` once at the start of step STEP (default 1): kept in fp32, in the 16-bit
    /// working copy for that step under bf16/fp16; docs/scope.md.
    #[arg(long = "perturb", value_name = "POINT:KIND[@STEP]")]
    pub perturb: Vec<String>,
    /// Seed of --perturb's random numbers (the same seed gives the same run).
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub perturb_seed: u64,
    /// Held-out data (the kinds --data takes): the mean loss over --eval-iters global batches
    /// of it (its samples from 0), forward only, after every --eval-interval steps and after
    /// the last; in the progress output, the log and the report (`evals`). See docs/eval.md.
    #[arg(long, value_name = "synthetic|FILE")]
    pub eval_data: Option<String>,
    /// Evaluate after every N steps (steps N, 2N, ...) as well as after the last.
    #[arg(long, value_name = "N", requires = "eval_data")]
    pub eval_interval: Option<u64>,
    /// Global batches per evaluation [default: 10].
    #[arg(long, value_name = "K", requires = "eval_data")]
    pub eval_iters: Option<u64>,
    /// When stdout is not a terminal (Slurm, nohup, a pipe): print a log line every N steps
    /// (step, loss averaged over the N steps, grad norm, lr, tokens/s, elapsed, ETA); the
    /// summary's final loss is the mean of the last N steps [default: 10].
    #[arg(long, value_name = "N")]
    pub log_interval: Option<u64>,
    /// Write one JSON object per step and per evaluation to FILE (JSON lines, flushed per
    /// line: `tail -f` it); created or truncated when the run starts.
    #[arg(long, value_name = "FILE.jsonl")]
    pub log: Option<PathBuf>,
    /// With --comm mpi: reduce sums in group order, so the run is bit-identical to the
    /// local-thread run of the plan (slower); by default MPI's own collectives
    /// (MPI_Allreduce, MPI_Reduce_scatter_block), equal to local threads to rounding. The
    /// local communicator is deterministic anyway: there it changes nothing.
    #[arg(long)]
    pub deterministic: bool,
    /// Watch for slow ranks and slow links while training: after every step rank 0 runs
    /// `megac scan`'s detector over the last steps and prints one warning line per new
    /// finding (the rank or link, the step, the score) on stderr. It warns of ranks at least
    /// 1.3× slower than their peers; `--trace` and `megac scan` show smaller slowdowns. See
    /// docs/scan.md.
    #[arg(long)]
    pub scan: bool,
    /// Fused kernels (issue 19; docs/mlir.md): `on` (the default in a build with the `mlir`
    /// feature; an error without it) runs each fused group of elementwise and row-reduction
    /// instructions as one kernel generated through MLIR, compiled at startup or loaded
    /// from the kernel cache; `off` (the default without the feature) runs every
    /// instruction with the Rust kernels.
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    pub fusion: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a model.toml and print a one-screen summary (parameters, FLOPs, layout, ranks).
    #[command(
        after_help = "Example:\n  megac check examples/llama3-8b.toml --set parallel.tp=4 --set parallel.dp=2"
    )]
    Check {
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Print the IR of a model after a pass (default: after the last pass).
    #[command(
        after_help = "Example:\n  megac dump examples/llama-tiny.toml --after build\n  megac dump examples/llama-tiny.toml --set parallel.dp=2 --rank 1"
    )]
    Dump {
        #[command(flatten)]
        model: ModelArgs,
        /// Stop after this pass (see `megac passes`); `fuse` prints the fusion pass's
        /// groups of the compiled plan's programs instead of the IR.
        #[arg(long, value_name = "PASS")]
        after: Option<String>,
        /// Show rank R's local shapes instead of the global ones.
        #[arg(long, value_name = "R")]
        rank: Option<usize>,
        /// Probe points the `probe` pass inserts (as `megac scope --probe`; repeatable).
        #[arg(long = "probe", value_name = "PATTERN")]
        probes: Vec<String>,
        /// Perturbations the `perturb` pass inserts (as `megac train --perturb`, training
        /// streams; repeatable).
        #[arg(long = "perturb", value_name = "POINT:KIND[@STEP]")]
        perturb: Vec<String>,
    },
    /// Compile a model.toml into a plan directory (PLAN_DIR/plan.json).
    #[command(
        after_help = "Example:\n  megac compile examples/llama-tiny.toml -o /tmp/llama-plan"
    )]
    Compile {
        #[command(flatten)]
        model: ModelArgs,
        /// Output directory (checked before compiling; created, with missing parents, when
        /// the plan is written).
        #[arg(short = 'o', long = "out", value_name = "PLAN_DIR")]
        out: PathBuf,
        /// Also write `mlir`: one MLIR module per role beside plan.json
        /// (`role-<name>.mlir`, verified by MLIR; needs a build with the `mlir` feature).
        #[arg(long, value_enum, value_name = "FORMAT")]
        emit: Option<commands::compile::Emit>,
        /// Compile an inference plan: the forward only (up to the loss), without gradients,
        /// optimizer state or an optimizer program (docs/generate.md).
        #[arg(long)]
        inference: bool,
        /// With --inference: a KV-cache plan, as `megac generate` runs (one sample; the
        /// prefill, a one-token decode step and the caches in one plan; docs/generate.md).
        #[arg(long, requires = "inference")]
        kv_cache: bool,
    },
    /// Print a plan's memory by class (parameters, gradients, optimizer state, activations) and
    /// FLOPs, or the whole plan as text (`--program`).
    #[command(
        after_help = "Example:\n  megac compile examples/llama-tiny.toml -o /tmp/llama-plan\n  megac inspect /tmp/llama-plan --json\n  megac inspect /tmp/llama-plan --program"
    )]
    Inspect {
        /// Plan directory written by `megac compile`.
        #[arg(value_name = "PLAN_DIR")]
        plan: PathBuf,
        /// Machine-readable output.
        #[arg(long, conflicts_with = "program")]
        json: bool,
        /// Print the whole plan as text instead (header, buffer table, parameters, and per
        /// role its programs, one instruction per line, and pipeline actions): for reading
        /// and diffing plans.
        #[arg(long)]
        program: bool,
        /// Warn (on stderr) when a rank's memory exceeds one device of this cluster: a
        /// cluster.toml or a preset (a100-80g, h100-sxm, h200; default: the plan's
        /// `[cluster]`, else h100-sxm).
        #[arg(long, value_name = "CLUSTER.toml|PRESET")]
        cluster: Option<String>,
    },
    /// Execute a compiled plan: train, print progress, write a report.
    #[command(
        after_help = "Example:\n  megac compile examples/llama-tiny.toml -o /tmp/llama-plan\n  megac run /tmp/llama-plan --steps 50 --data examples/data/corpus.txt --report run.json"
    )]
    Run {
        /// Plan directory written by `megac compile`.
        #[arg(value_name = "PLAN_DIR")]
        plan: PathBuf,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Compile and run in one go: the main job.
    #[command(
        after_help = "Example:\n  megac train examples/llama-tiny.toml --data examples/data/corpus.txt --steps 300"
    )]
    Train {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Run a plan on N processes with mpirun (one per rank; across nodes with a hostfile).
    #[command(
        after_help = "Run options are those of `megac run`; every rank runs `megac run PLAN_DIR --comm mpi`.\nThe mpirun command is printed first. OMPI_MCA_<name> variables override megac's --mca choices;\nMEGAC_MPIRUN names the mpirun to use.\n\nExample:\n  megac compile examples/llama-tiny.toml --set parallel.dp=2 -o /tmp/dp2\n  megac launch -n 2 /tmp/dp2 --steps 20 --report run.json\n  megac launch -n 2 --hostfile examples/hostfile /tmp/dp2 --steps 20"
    )]
    Launch(commands::launch::LaunchArgs),
    /// Inspect or export a checkpoint written by `--save`.
    #[command(
        after_help = "Example:\n  megac train examples/llama-tiny.toml --steps 2 --save /tmp/llama-ckpt\n  megac checkpoint inspect /tmp/llama-ckpt\n  megac checkpoint export /tmp/llama-ckpt -o /tmp/llama-ckpt.safetensors"
    )]
    Checkpoint {
        #[command(subcommand)]
        action: commands::checkpoint::Action,
    },
    /// Prove before a run that every process group's members make the same collective calls
    /// in the same order with the same sizes (`megac run` checks this too).
    #[command(
        after_help = "Example:\n  megac compile examples/llama-tiny.toml -o /tmp/llama-plan\n  megac check-plan /tmp/llama-plan"
    )]
    CheckPlan {
        /// Plan directory written by `megac compile`.
        #[arg(value_name = "PLAN_DIR")]
        plan: PathBuf,
    },
    /// Show the pipeline schedule each pipeline rank follows (per-rank timelines, bubble
    /// and peak in-flight micro-batches, with unit or model costs), from a model.toml's
    /// `[parallel]` section or from a compiled plan directory (the action lists it carries).
    #[command(
        after_help = "Examples:\n  megac schedule examples/llama3-70b.toml --set parallel.schedule=\"zb-h1\"\n  megac schedule examples/gpt3-175b.toml --format json\n  megac schedule examples/llama3-70b.toml --format svg -o schedule.svg --costs model\n  megac compile examples/llama-tiny.toml --set parallel.pp=2 -o /tmp/pp2-plan\n  megac schedule /tmp/pp2-plan --format svg -o plan-schedule.svg"
    )]
    Schedule {
        #[command(flatten)]
        model: ModelArgs,
        /// `text` (one row per rank), `json`, or `svg` (a Gantt chart: one lane per rank,
        /// boxes at their simulated times, bubble and peak in-flight per rank).
        #[arg(long, default_value = "text", value_name = "text|json|svg")]
        format: String,
        /// Also show the sends and receives between pipeline ranks (text).
        #[arg(long)]
        comm: bool,
        /// Action durations: `unit` (F = B = W = 1, free transfers) or `model` (for a
        /// model.toml, per-chunk F/B/W from the model's per-layer FLOPs, head on the last
        /// chunk; for a plan directory, megac-sim's simulation of the plan on `--cluster`,
        /// in seconds; see docs/schedules.md).
        #[arg(long, default_value = "unit", value_name = "unit|model")]
        costs: String,
        /// Cluster for `--costs model` on a plan directory (a cluster.toml or a preset
        /// name; default: the plan's `[cluster]`, else h100-sxm).
        #[arg(long, value_name = "CLUSTER.toml|PRESET")]
        cluster: Option<String>,
        /// Write the output to FILE instead of standard output (missing folders are created).
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// Write the [model] section of a model.toml from a Hugging Face config.json
    /// (transformers 4 or 5; refuses, naming the key, what megac cannot express).
    #[command(
        name = "import-hf",
        after_help = "Example:\n  megac import-hf tests/golden/qwen2/init_config.json -o qwen2.toml\n  megac check qwen2.toml"
    )]
    ImportHf {
        /// A transformers config.json (save_pretrained's, or the Hub's).
        #[arg(value_name = "CONFIG.json")]
        config: PathBuf,
        /// The model.toml to write (checked before reading; missing folders are created).
        #[arg(short = 'o', long = "out", value_name = "MODEL.toml")]
        out: PathBuf,
    },
    /// Run a model forward from a prompt and print the tokens it generates (greedy by
    /// default, or sampled with --temperature, --top-k, --top-p, --seed).
    #[command(
        after_help = "Example:\n  megac generate tests/golden/llama/model.toml --init tests/golden/llama/init.safetensors --prompt \"Hi\" --max-new-tokens 8 --format json"
    )]
    Generate(commands::generate::GenerateArgs),
    /// Run a model forward on one input and write the activations at named probe points
    /// (residual stream, attention probabilities, attention and MLP outputs, logits) to a
    /// safetensors file; optionally perturbed, with a clean-vs-perturbed report. `megac scope
    /// view` renders such a file as one self-contained HTML page.
    #[command(
        after_help = "Example:\n  megac scope tests/golden/llama/model.toml --init tests/golden/llama/init.safetensors --tokens 3,14,15,92 --probe embed --probe 'layers.*.attn.probs' --probe logits -o probes.safetensors\n  megac scope tests/golden/llama/model.toml --init tests/golden/llama/init.safetensors --tokens 3,14,15,92 --probe logits -o out.safetensors --perturb 'layers.0.out:noise(0.5)' --report r.json\n  megac scope view out.safetensors --report r.json -o view.html"
    )]
    Scope(commands::scope::ScopeCli),
    /// Evaluate weights on a data file: the mean loss (and perplexity) of the model's forward
    /// over global batches of it, in any layout.
    #[command(
        after_help = "Example:\n  megac train examples/llama-tiny.toml --steps 20 --data examples/data/corpus.txt --save-params /tmp/llama-20/model.safetensors\n  megac eval examples/llama-tiny.toml --init /tmp/llama-20/model.safetensors --data examples/data/corpus.txt --iters 4\n  megac eval examples/llama-tiny.toml --init /tmp/llama-20/model.safetensors --data examples/data/corpus.txt --iters 2 --set parallel.tp=2 --format json"
    )]
    Eval(commands::eval::EvalArgs),
    /// MegaScan: align the clocks of a traced run's ranks (`--trace DIR`), find slow ranks and
    /// slow links, and merge the ranks into one Perfetto timeline.
    #[command(
        after_help = "Example:\n  megac train examples/llama-tiny.toml --set parallel.dp=4 --set train.global_batch=16 --steps 4 --trace /tmp/scan-dp4 --inject slow-rank:2:3\n  megac scan /tmp/scan-dp4\n  megac scan /tmp/scan-dp4 --format json -o merged.json\n  megac scan /tmp/scan-dp4 --svg /tmp/scan-dp4/timeline.svg"
    )]
    Scan(commands::scan::ScanArgs),
    /// List the compiler's passes in pipeline order.
    #[command(after_help = "Example:\n  megac passes")]
    Passes,
    /// Predict a plan's step time, tokens/s, MFU, bubble and memory on a cluster.
    #[command(
        after_help = "Example:\n  megac compile examples/llama-tiny.toml -o /tmp/llama-plan\n  megac simulate /tmp/llama-plan --cluster h100-sxm --format json --trace sim.json"
    )]
    Simulate(commands::simulate::SimulateArgs),
    /// Search every layout of a model on N GPUs and print the fastest that fit in memory.
    #[command(
        after_help = "Example:\n  megac plan examples/llama3-8b.toml --gpus 8 --top 5 --emit best.toml"
    )]
    Plan(commands::plan::PlanArgs),
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so printing to a closed pipe (`megac simulate PLAN | head -1`)
    // would panic; end quietly instead, as Unix tools do (the shell sees 141).
    // SAFETY: called first, before any thread exists; SIG_DFL is a valid disposition.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { model } => commands::check::run(&model),
        Command::Dump {
            model,
            after,
            rank,
            probes,
            perturb,
        } => commands::dump::run(&model, after.as_deref(), rank, &probes, &perturb),
        Command::Passes => commands::passes::run(),
        Command::ImportHf { config, out } => commands::import_hf::run(&config, &out),
        Command::Generate(args) => commands::generate::run(&args),
        Command::Scope(cli) => commands::scope::run_cli(&cli),
        Command::Eval(args) => commands::eval::run(&args),
        Command::CheckPlan { plan } => commands::check_plan::run(&plan),
        Command::Schedule {
            model,
            format,
            comm,
            costs,
            cluster,
            output,
        } => commands::schedule::run(
            &model,
            &commands::schedule::Options {
                format: &format,
                with_comm: comm,
                costs: &costs,
                cluster: cluster.as_deref(),
                output: output.as_deref(),
            },
        ),
        Command::Simulate(args) => commands::simulate::run(&args),
        Command::Scan(args) => commands::scan::run(&args),
        Command::Plan(args) => commands::plan::run(&args),
        Command::Compile {
            model,
            out,
            emit,
            inference,
            kv_cache,
        } => commands::compile::run(
            &model,
            &out,
            emit,
            if inference {
                megac_ir::plan::PlanKind::Inference
            } else {
                megac_ir::plan::PlanKind::Train
            },
            kv_cache,
        ),
        Command::Inspect {
            plan,
            json,
            program,
            cluster,
        } => commands::inspect::run(&plan, json, program, cluster.as_deref()),
        Command::Run { plan, run } => commands::run::run(&plan, &run),
        Command::Launch(args) => commands::launch::run(&args),
        Command::Checkpoint { action } => commands::checkpoint::run(&action),
        Command::Train { model, run } => commands::run::train_model(&model, &run),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprint!("{message}");
            if !message.ends_with('\n') {
                eprintln!();
            }
            ExitCode::FAILURE
        }
    }
}

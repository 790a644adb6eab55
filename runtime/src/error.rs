//! The runtime's error type: one variant per subsystem, each carrying the file (or data
//! source) it is about and a complete, human-readable message.

/// An error from the runtime. `Display` gives the full message; the command line prints it
/// once and exits non-zero. Nothing in the runtime panics on user input.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RuntimeError {
    /// The training data (`--data synthetic|FILE`) could not be opened or is unusable.
    #[error("data {source_name}: {message}")]
    Data {
        /// The data spec as the user gave it (`synthetic` or the file path).
        source_name: String,
        /// What is wrong, with the numbers involved.
        message: String,
    },
    /// A Hugging Face tokenizer (`--tokenizer tokenizer.json`) could not be read or does not
    /// fit the model or the data.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// The tokenizer file as the user gave it.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A parameter file (safetensors, `--init` / `--save-params`) could not be read,
    /// does not match the model, or could not be written.
    #[error("parameters {path}: {message}")]
    Params {
        /// The safetensors path as the user gave it.
        path: String,
        /// What is wrong, naming the tensors involved.
        message: String,
    },
    /// The plan is malformed or inconsistent (a corrupted or hand-edited plan.json).
    #[error("plan: {0}")]
    Plan(String),
    /// Training diverged: a step's loss or gradient norm is NaN or infinite. The run stops
    /// at that step and saves nothing (message: the step, the value, what to try).
    #[error("{0}")]
    NonFinite(String),
    /// The plan needs something this runtime build cannot do yet.
    #[error("{0}")]
    Unsupported(String),
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
    /// A checkpoint (`--save`, `--load`, `megac checkpoint`) could not be written, found or
    /// used: the file and what is wrong with it.
    #[error("checkpoint {0}")]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
}

impl From<crate::data::tokenizer::TokenizerError> for RuntimeError {
    fn from(e: crate::data::tokenizer::TokenizerError) -> Self {
        RuntimeError::Tokenizer {
            path: e.path,
            message: e.message,
        }
    }
}

impl From<crate::data::megatron::FileError> for RuntimeError {
    fn from(e: crate::data::megatron::FileError) -> Self {
        RuntimeError::Data {
            source_name: e.file,
            message: e.message,
        }
    }
}

//! The pass manager: named passes run in a fixed order over a [`Module`]; each pass's output
//! can be printed (`megac dump --after PASS`), and the verifier can run after every pass.

use megac_ir::{print_graph, verify, Graph, ModelSpec};

use crate::build::build_graph;
use crate::PassError;

/// What the passes transform: the spec and, once built, the graph.
#[derive(Clone, Debug)]
pub struct Module {
    /// The validated model description.
    pub spec: ModelSpec,
    /// The Graph IR, present after the `build` pass.
    pub graph: Option<Graph>,
}

impl Module {
    /// A module holding only the spec.
    pub fn new(spec: ModelSpec) -> Module {
        Module { spec, graph: None }
    }

    /// The text form of the current IR.
    pub fn dump(&self) -> String {
        match &self.graph {
            Some(g) => print_graph(g),
            None => String::new(),
        }
    }
}

/// A named transformation of a [`Module`].
pub struct Pass {
    /// Name used by `--after` and `megac passes`.
    pub name: &'static str,
    /// One-line description for `megac passes`.
    pub description: &'static str,
    run: fn(&mut Module) -> Result<(), PassError>,
}

/// Every pass, in pipeline order.
pub fn pipeline() -> Vec<Pass> {
    vec![Pass {
        name: "build",
        description: "lower the model spec to the Graph IR: forward of one training step, global view, HF parameter names",
        run: |m| {
            m.graph = Some(build_graph(&m.spec)?);
            Ok(())
        },
    }]
}

/// Names of every pass, in order.
pub fn pass_names() -> Vec<&'static str> {
    pipeline().iter().map(|p| p.name).collect()
}

/// Run the pipeline on `spec`, stopping after the pass named `after` (all passes when None).
/// With `verify_each`, the verifier checks the graph after every pass.
pub fn run_pipeline(
    spec: ModelSpec,
    after: Option<&str>,
    verify_each: bool,
) -> Result<Module, PassError> {
    let passes = pipeline();
    if let Some(name) = after {
        if !passes.iter().any(|p| p.name == name) {
            return Err(PassError::UnknownPass {
                name: name.to_string(),
                known: pass_names().join(", "),
            });
        }
    }
    let mut module = Module::new(spec);
    for pass in &passes {
        (pass.run)(&mut module)?;
        if verify_each {
            if let Some(g) = &module.graph {
                verify(g).map_err(|message| PassError::Verify {
                    pass: pass.name,
                    message,
                })?;
            }
        }
        if after == Some(pass.name) {
            break;
        }
    }
    Ok(module)
}

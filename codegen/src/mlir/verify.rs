//! MLIR itself, through melior: parse a module's text, run the verifier, print it.

use std::cell::RefCell;
use std::rc::Rc;

use melior::dialect::DialectRegistry;
use melior::ir::operation::OperationLike;
use melior::ir::Module;
use melior::utility::register_all_dialects;
use melior::Context;

/// A context with every upstream dialect loaded.
pub fn context() -> Context {
    let registry = DialectRegistry::new();
    register_all_dialects(&registry);
    let context = Context::new();
    context.append_dialect_registry(&registry);
    context.load_all_available_dialects();
    context
}

/// Parse `source`, verify it and print it: MLIR's canonical text of the module, or the
/// failing stage (`parse`, `verify`) with MLIR's diagnostics.
pub fn canonical(source: &str) -> Result<String, (&'static str, String)> {
    let context = context();
    canonical_in(&context, source)
}

/// [`canonical`] in a given context.
pub fn canonical_in(context: &Context, source: &str) -> Result<String, (&'static str, String)> {
    let messages = Rc::new(RefCell::new(Vec::<String>::new()));
    let sink = messages.clone();
    let id = context.attach_diagnostic_handler(move |d| {
        sink.borrow_mut().push(format!("{}: {d}", d.location()));
        true
    });
    let result = (|| {
        let module = Module::parse(context, source).ok_or("parse")?;
        if !module.as_operation().verify() {
            return Err("verify");
        }
        Ok(module.as_operation().to_string())
    })();
    context.detach_diagnostic_handler(id);
    result.map_err(|stage| {
        let m = messages.borrow();
        let text = if m.is_empty() {
            "(no diagnostics)".to_string()
        } else {
            m.join("; ")
        };
        (stage, text)
    })
}

//! The perturbation language of `megac scope --perturb` and `megac train --perturb`
//! (`POINT:KIND[@STEP]`, docs/scope.md): what the `perturb` pass (megac-passes) compiles into
//! `perturb` ops and the runtime applies to weights during training.

/// A perturbation's kind (docs/scope.md).
#[derive(Clone, Debug, PartialEq)]
pub enum PerturbKind {
    /// Add Gaussian noise of standard deviation `sigma` times the tensor's RMS.
    Noise(f64),
    /// Multiply by a factor.
    Scale(f64),
    /// Flip one random bit of the field in each element with probability `rate`.
    Bitflip(BitField, f64),
    /// Zero one query head's output (`layers.{i}.attn` only): attention knockout.
    ZeroHead(u64),
    /// Replace the activation by the tensor of the point's name in a probe file (`megac
    /// scope -o`) of another input of the same length: activation patching.
    Patch(std::path::PathBuf),
}

/// The bits of an IEEE-754 float32 a bit flip picks from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitField {
    /// Bit 31.
    Sign,
    /// Bits 23..=30.
    Exponent,
    /// Bits 0..=22.
    Mantissa,
}

/// `POINT:KIND`: a probe point (or `weights.NAME`, a parameter) and what to do to it.
#[derive(Clone, Debug, PartialEq)]
pub struct Perturbation {
    /// The point (`layers.0.out`) or `weights.` and a parameter name.
    pub point: String,
    /// What is done to it.
    pub kind: PerturbKind,
}

impl Perturbation {
    /// Parse `POINT:KIND`, KIND one of `noise(SIGMA)`, `scale(X)`,
    /// `bitflip(sign|exponent|mantissa, RATE)`, `zero-head(HEAD)`, `patch(FILE)`.
    pub fn parse(text: &str) -> Result<Perturbation, String> {
        let bad = |why: &str| {
            format!(
                "--perturb {text}: {why} (expected POINT:KIND, KIND one of noise(SIGMA), \
                 scale(X), bitflip(sign|exponent|mantissa, RATE), zero-head(HEAD), \
                 patch(FILE))"
            )
        };
        let (point, kind) = text.split_once(':').ok_or_else(|| bad("no `:`"))?;
        let (name, args) = kind
            .strip_suffix(')')
            .and_then(|k| k.split_once('('))
            .ok_or_else(|| bad(&format!("`{kind}` is not KIND(ARGS)")))?;
        if name.trim() == "patch" {
            if args.trim().is_empty() {
                return Err(bad("patch needs a FILE"));
            }
            if point.is_empty() {
                return Err(bad("no point"));
            }
            return Ok(Perturbation {
                point: point.to_string(),
                kind: PerturbKind::Patch(args.trim().into()),
            });
        }
        let args: Vec<&str> = args.split(',').map(str::trim).collect();
        let num = |s: &str| -> Result<f64, String> {
            s.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite())
                .ok_or_else(|| bad(&format!("`{s}` is not a finite number")))
        };
        let kind = match (name.trim(), &args[..]) {
            ("noise", [sigma]) => {
                let s = num(sigma)?;
                if s < 0.0 {
                    return Err(bad("noise's SIGMA must be >= 0"));
                }
                PerturbKind::Noise(s)
            }
            ("scale", [x]) => PerturbKind::Scale(num(x)?),
            ("zero-head", [h]) => PerturbKind::ZeroHead(
                h.parse::<u64>()
                    .map_err(|_| bad(&format!("`{h}` is not a head index")))?,
            ),
            ("bitflip", [field, rate]) => {
                let field = match *field {
                    "sign" => BitField::Sign,
                    "exponent" => BitField::Exponent,
                    "mantissa" => BitField::Mantissa,
                    other => {
                        return Err(bad(&format!(
                            "bit field `{other}` is not sign, exponent or mantissa"
                        )))
                    }
                };
                let r = num(rate)?;
                if !(0.0..=1.0).contains(&r) {
                    return Err(bad("bitflip's RATE must be in [0, 1]"));
                }
                PerturbKind::Bitflip(field, r)
            }
            (other, _) => {
                return Err(bad(&format!(
                    "`{other}` with {} argument(s) is not a kind",
                    args.len()
                )))
            }
        };
        if point.is_empty() {
            return Err(bad("no point"));
        }
        Ok(Perturbation {
            point: point.to_string(),
            kind,
        })
    }
}

/// A perturbation of a training run: what, and at which step (None: every step for an
/// activation, step 1 for a weight).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainPerturbation {
    /// The point and kind.
    pub perturbation: Perturbation,
    /// The 1-based step, if one.
    pub step: Option<u64>,
}

impl TrainPerturbation {
    /// Parse `POINT:KIND` or `POINT:KIND@STEP`.
    pub fn parse(text: &str) -> Result<TrainPerturbation, String> {
        let (body, step) = match text.rsplit_once('@') {
            Some((body, step)) => {
                let s = step
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|&s| s >= 1)
                    .ok_or_else(|| {
                        format!("--perturb {text}: `@{step}` is not a step (a number >= 1)")
                    })?;
                (body, Some(s))
            }
            None => (text, None),
        };
        let perturbation = Perturbation::parse(body)?;
        if matches!(perturbation.kind, PerturbKind::Patch(_)) {
            return Err(format!(
                "--perturb {text}: patch replaces one input's activations, for megac scope; \
                 training perturbations are noise, scale, bitflip and zero-head"
            ));
        }
        Ok(TrainPerturbation { perturbation, step })
    }
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters.
pub fn glob(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

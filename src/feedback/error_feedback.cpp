// PENDING: replaced by the real feedback.
#include "feedback/factories.h"

namespace gradcomp {
std::unique_ptr<Feedback> make_error_feedback(Spec& spec) { spec.fail("PENDING: not written yet"); }
}  // namespace gradcomp
